import pytest

from deploy.check import load_config_classes, violations
from tests.deploy.manifests import OVERLAYS, find, rendered


@pytest.fixture(scope="module")
def configs():
    return load_config_classes()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_pass_every_rule(overlay, configs):
    assert violations(rendered(overlay), configs) == []


def pod(objs, name):
    return find(objs, "Deployment", name)["spec"]["template"]["spec"]


def container(objs, name):
    return pod(objs, name)["containers"][0]


def set_env(c, name, value):
    c["env"] = [e for e in c["env"] if e["name"] != name] + [{"name": name, "value": value}]


# each mutation breaks one rule; the checker must report it (message fragment)
MUTATIONS = [
    ("probe removed", lambda o: container(o, "router").pop("livenessProbe"), "no gRPC livenessProbe"),
    ("probe on the wrong port", lambda o: container(o, "attention")["readinessProbe"]["grpc"].update(port=1), "readinessProbe port 1"),
    ("no memory limit", lambda o: container(o, "control")["resources"]["limits"].pop("memory"), "no memory limit"),
    ("gpu without a limit", lambda o: set_env(container(o, "experts-b"), "MOEMESH_EXPERT_DEVICE", "cuda:0"), "without an nvidia.com/gpu limit"),
    ("attention on a gpu without a limit", lambda o: set_env(container(o, "attention"), "MOEMESH_ATTENTION_DEVICE", "cuda:0"), "attention: computes on cuda:0 without an nvidia.com/gpu limit"),
    ("unreadable device", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_ATTENTION_DEVICE="gpu0"), "device must be cpu, cuda or cuda:N, got 'gpu0'"),
    ("root filesystem writable", lambda o: container(o, "experts-a")["securityContext"].update(readOnlyRootFilesystem=False), "not read-only"),
    ("escalation allowed", lambda o: container(o, "router")["securityContext"].pop("allowPrivilegeEscalation"), "privilege escalation"),
    ("capabilities kept", lambda o: container(o, "router")["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "capabilities"),
    ("runs as root", lambda o: pod(o, "control")["securityContext"].update(runAsUser=0), "runs as uid 0"),
    ("root allowed", lambda o: (pod(o, "control")["securityContext"].pop("runAsNonRoot"),
                                container(o, "control")["securityContext"].pop("runAsNonRoot")), "runAsNonRoot is not true"),
    ("selector drift", lambda o: find(o, "Deployment", "router")["spec"]["selector"]["matchLabels"].update(x="y"), "selector does not match"),
    ("service selects nothing", lambda o: find(o, "Service", "control")["spec"]["selector"].update(app="nope"), "selects no pods"),
    ("pool without a PDB", lambda o: o.remove(find(o, "PodDisruptionBudget", "experts-b")), "experts-b: no PodDisruptionBudget"),
    ("pool without an HPA", lambda o: o.remove(find(o, "HorizontalPodAutoscaler", "experts-a")), "experts-a: no HorizontalPodAutoscaler"),
    ("gateway without a PDB", lambda o: o.remove(find(o, "PodDisruptionBudget", "gateway")), "gateway: no PodDisruptionBudget"),
    ("gateway without an HPA", lambda o: o.remove(find(o, "HorizontalPodAutoscaler", "gateway")), "gateway: no HorizontalPodAutoscaler"),
    ("gateway ready on the wrong path", lambda o: container(o, "gateway")["readinessProbe"]["httpGet"].update(path="/metrics"), "is not /health"),
    ("gateway with a gRPC probe", lambda o: container(o, "gateway").update(livenessProbe={"grpc": {"port": 8000}}), "no HTTP livenessProbe"),
    ("gateway on another port", lambda o: set_env(container(o, "gateway"), "MOEMESH_GATEWAY_PORT", "9000"), "declares HTTP port 8000"),
    ("PDB over two pools", lambda o: find(o, "PodDisruptionBudget", "experts-a")["spec"]["selector"]["matchLabels"].pop("moemesh.io/pool"), "selects 2 Deployments"),
    ("unknown config key", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_EXPERT_TOP_KAY="2"), "has no field 'top_kay'"),
    ("unknown service", lambda o: set_env(container(o, "router"), "MOEMESH_FRONTEND_PORT", "1"), "names no service"),
    ("unreadable value", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_CONTROL_EXPECTED_EXPERT_SERVERS="many"), "cannot read"),
    ("port mismatch", lambda o: set_env(container(o, "experts-a"), "MOEMESH_EXPERT_PORT", "50099"), "binds port 50099"),
    ("loopback bind", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].pop("MOEMESH_ATTENTION_HOST"), "binds '127.0.0.1'"),
    ("metrics port the service does not serve",
     lambda o: container(o, "router")["env"].pop(1), "router serves metrics on None, declares 9400"),
    ("no metrics port", lambda o: container(o, "control")["ports"].pop(1), "control declares no metrics port"),
    ("metrics port not admitted", lambda o: o.remove(find(o, "NetworkPolicy", "metrics-scrape")), "metrics port 9400 is admitted by no"),
    ("bad target port", lambda o: find(o, "Service", "router")["spec"]["ports"][0].update(targetPort="http"), "targetPort 'http'"),
    ("control port closed to experts", lambda o: find(o, "NetworkPolicy", "control-ingress")["spec"]["ingress"][0]["from"].pop(0),
     "control port 50071 does not admit expert, which calls it"),
    ("router admitted to the expert servers", lambda o: find(o, "NetworkPolicy", "expert-ingress")["spec"]["ingress"][0]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "router"}}}), "expert port 50061 admits router, which never calls it"),
    ("one policy for every internal port, the router included (the old mesh-internal)",
     lambda o: find(o, "NetworkPolicy", "control-ingress")["spec"]["ingress"][0].update(
         {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "moemesh"}}}]}), "control port 50071 admits router"),
    ("attention open to the world", lambda o: find(o, "NetworkPolicy", "attention-ingress")["spec"]["ingress"][0].pop("from"),
     "attention port 50052 admits anything outside"),
    ("no policy for the expert servers", lambda o: o.remove(find(o, "NetworkPolicy", "expert-ingress")),
     "expert port 50061 does not admit attention"),
    ("no policy selects the expert servers at all",
     lambda o: [o.remove(find(o, "NetworkPolicy", n)) for n in ("expert-ingress", "metrics-scrape")], "expert port 50061 admits anything outside"),
    ("no mesh token mounted", lambda o: pod(o, "experts-a").update(volumes=[v for v in pod(o, "experts-a")["volumes"] if v["name"] != "mesh-token"]),
     "mesh token file /var/run/moemesh/mesh-token/token is in no mounted Secret"),
    ("no mesh token", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].pop("MOEMESH_CONTROL_MESH_TOKEN_FILE"), "control has no mesh token file"),
    ("auth off", lambda o: set_env(container(o, "attention"), "MOEMESH_ATTENTION_INSECURE_NO_AUTH", "true"), "runs with insecure_no_auth"),
    ("TLS on one service only", lambda o: set_env(container(o, "router"), "MOEMESH_ROUTER_TLS_CERT", "/etc/tls.crt"),
     "TLS is on for some services but not for"),
    ("grace too short", lambda o: pod(o, "experts-a").update(terminationGracePeriodSeconds=30), "terminationGracePeriodSeconds 30 < "),
    ("drain longer than grace", lambda o: set_env(container(o, "experts-b"), "MOEMESH_EXPERT_DRAIN_TIMEOUT_S", "600"), "< preStop + drain"),
    ("no pod address", lambda o: container(o, "experts-a")["env"].pop(0), "does not advertise its pod IP"),
    ("control waits for more servers than start",
     lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_CONTROL_EXPECTED_EXPERT_SERVERS="3"), "waits for 3 expert servers"),
    ("attention behind a ClusterIP", lambda o: find(o, "Service", "attention")["spec"].pop("clusterIP"),
     "attention target 'attention:50052' is not a headless Service"),
    ("attention on another port", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_ROUTER_ATTENTION="attention:6000"),
     "Service attention has no port 6000"),
    ("attention never re-resolved", lambda o: find(o, "ConfigMap", "moemesh-config")["data"].update(MOEMESH_ROUTER_DISCOVERY_INTERVAL_S="0"),
     "discovery_interval_s is 0"),
    ("model writable", lambda o: pod(o, "attention")["volumes"][0]["persistentVolumeClaim"].pop("readOnly"), "model claim is not readOnly"),
]


@pytest.mark.parametrize("what, mutate, message", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_rule_catches_its_mistake(what, mutate, message, configs):
    objs = rendered("base")
    mutate(objs)
    found = violations(objs, configs)
    assert any(message in v for v in found), found


def test_gpu_overlay_puts_attention_replicas_on_their_gpu():
    objs = rendered("overlays/gpu")
    c = container(objs, "attention")
    assert {"name": "MOEMESH_ATTENTION_DEVICE", "value": "cuda:0"} in c["env"]
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert not any(e["name"] == "MOEMESH_ATTENTION_DEVICE" for e in container(rendered("overlays/cpu-dev"), "attention").get("env", []))


def test_gpu_overlay_serves_mtls_with_a_cert_manager_certificate():
    objs = rendered("overlays/gpu")
    cert = find(objs, "Certificate", "moemesh-mesh-tls")
    assert cert["apiVersion"] == "cert-manager.io/v1" and cert["spec"]["secretName"] == "moemesh-mesh-tls"
    assert {"server auth", "client auth"} <= set(cert["spec"]["usages"]) and cert["spec"]["issuerRef"]["name"]
    for name in ("control", "router", "attention", "experts-a", "experts-b"):
        c, p = container(objs, name), pod(objs, name)
        assert any(v.get("secret", {}).get("secretName") == "moemesh-mesh-tls" for v in p["volumes"]), name
        assert c["readinessProbe"]["grpc"]["port"] == 50081, name  # the plaintext health port
    config = find(objs, "ConfigMap", "moemesh-config")["data"]
    assert config["MOEMESH_EXPERT_TLS_SERVER_NAME"] == cert["spec"]["dnsNames"][0]
    # the plain overlay runs with the token only
    assert not any("TLS" in k for k in find(rendered("overlays/cpu-dev"), "ConfigMap", "moemesh-config")["data"])


def test_health_port_without_tls_probes_checked():
    objs = rendered("overlays/gpu")
    container(objs, "control")["ports"] = [p for p in container(objs, "control")["ports"] if p["name"] != "health"]
    assert any("health port 50081 is not declared" in v for v in violations(objs))
