"""Policy rules on who may reach and call the mesh: network policies per caller, credentials mounted.

- `check_network_policies`: each internal service's gRPC port admits exactly the components that
  call it (`CALLERS`): none missing (the mesh would break), none more (the public router must not
  reach the control plane or the expert servers), never a namespace or the whole world;
- `check_credentials`: every `moemesh serve` container reads the mesh token from a file inside a
  mounted Secret (never runs with `insecure_no_auth`), its TLS files (if any) come from a mounted
  Secret too, and TLS is on for all services or none (a TLS server refuses plaintext callers).
"""
from __future__ import annotations

from typing import Any

from deploy.manifest import Obj, config_value, effective_env, grpc_port_of, obj_name, pod_specs, selector_matches, service_of, template_labels_of, workloads_of

COMPONENT = "app.kubernetes.io/component"
# service -> the components whose pods call its gRPC port
CALLERS = {
    "control": {"expert", "attention", "gateway"},  # register, heartbeat, placement stream, failure reports; the chat page's status
    "attention": {"router"},  # sequences
    "expert": {"attention", "control"},  # expert calls; load/drop experts, probes
}
OUTSIDE = "anything outside the mesh's pods"


def _components(objs: list[Obj], selector: Obj) -> set[str]:
    return {template_labels_of(w).get(COMPONENT, "?") for w in workloads_of(objs) if selector_matches(selector, template_labels_of(w))}


def _admitted(objs: list[Obj], labels: dict[str, str], port: int) -> set[str]:
    """Components (or OUTSIDE) the NetworkPolicies let reach `port` on pods with `labels`."""
    policies = [p for p in objs if p.get("kind") == "NetworkPolicy" and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and selector_matches(p["spec"].get("podSelector"), labels)]
    if not policies:
        return {OUTSIDE}  # no policy selects the pod: everything is admitted
    out: set[str] = set()
    for p in policies:
        for rule in p["spec"].get("ingress", []) or []:
            ports = rule.get("ports")
            if ports and not any(q.get("port") in (port, None) for q in ports):
                continue
            peers = rule.get("from")
            if not peers:
                out.add(OUTSIDE)
                continue
            for peer in peers:
                if "ipBlock" in peer or "namespaceSelector" in peer:
                    out.add(OUTSIDE)
                elif "podSelector" in peer:
                    out |= _components(objs, peer["podSelector"])
    return out


def check_network_policies(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    for o in workloads_of(objs):
        for c in pod_specs(o)[0].get("containers", []):
            service = service_of(c)
            if service not in CALLERS:
                continue
            port = grpc_port_of(c)
            admitted = _admitted(objs, template_labels_of(o), port)
            for missing in sorted(CALLERS[service] - admitted):
                out.append(f"{obj_name(o)}: {service} port {port} does not admit {missing}, which calls it")
            for extra in sorted(admitted - CALLERS[service]):
                out.append(f"{obj_name(o)}: {service} port {port} admits {extra}, which never calls it")
    return out


def _secret_mounts(spec: Obj, container: Obj) -> list[str]:
    secrets = {v["name"] for v in spec.get("volumes", []) or [] if "secret" in v}
    return [m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts", []) or [] if m["name"] in secrets]


def check_credentials(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    tls_on: dict[str, bool] = {}
    for o in workloads_of(objs):
        spec = pod_specs(o)[0]
        for c in spec.get("containers", []):
            service = service_of(c)
            if service not in fields or "mesh_token_file" not in fields[service]:
                continue
            env = effective_env(c, objs)
            mounts = _secret_mounts(spec, c)
            if config_value(service, "insecure_no_auth", env, fields):
                out.append(f"{obj_name(o)}: {service} runs with insecure_no_auth: its internal API is open to every pod")
            token = config_value(service, "mesh_token_file", env, fields)
            if not token:
                out.append(f"{obj_name(o)}: {service} has no mesh token file (MOEMESH_{service.upper()}_MESH_TOKEN_FILE)")
            elif not any(token.startswith(m) for m in mounts):
                out.append(f"{obj_name(o)}: {service} mesh token file {token} is in no mounted Secret")
            files = {n: config_value(service, n, env, fields) for n in ("tls_cert", "tls_key", "tls_ca")}
            tls_on[obj_name(o)] = any(files.values())
            for name, path in files.items():
                if path and not any(str(path).startswith(m) for m in mounts):
                    out.append(f"{obj_name(o)}: {service} {name} {path} is in no mounted Secret")
    if len(set(tls_on.values())) > 1:
        plain = sorted(k for k, v in tls_on.items() if not v)
        out.append(f"TLS is on for some services but not for {', '.join(plain)} (a TLS server refuses their plaintext calls)")
    return out
