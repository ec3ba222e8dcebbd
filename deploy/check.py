"""Policy checks over rendered manifests: what CI asserts about `deploy/k8s` beyond the schemas.

    python -m deploy.check deploy/k8s/overlays/gpu     # prints violations, exit 1 if any

`violations(objs)` returns one line per broken rule (empty = all good):

- every long-running container (Deployments) has gRPC startup, readiness and liveness probes on
  its own gRPC port;
- every container (init containers and Jobs included) requests and limits cpu and memory; a GPU
  (`nvidia.com/gpu`) limit equals its request; a container told to compute on `cuda` has one;
- every container runs as non-root with a read-only root filesystem, no privilege escalation,
  all capabilities dropped, never privileged;
- Deployment selectors match their pod labels; every Service, PodDisruptionBudget and
  NetworkPolicy selects pods that exist; every autoscaler targets an existing Deployment;
- every expert pool (Deployment with component=expert) and the attention Deployment have their
  own PodDisruptionBudget and HorizontalPodAutoscaler;
- every `MOEMESH_<SERVICE>_<FIELD>` a manifest sets (env or an envFrom ConfigMap) names a field
  the service's config dataclass accepts (`moemesh serve` derives the same names), with a value
  that field can read (a `*_DEVICE` value is `cpu`, `cuda` or `cuda:N`);
- each `moemesh serve <service>` container binds 0.0.0.0 on the port its container and probes
  declare; a port named `metrics` is the service's `metrics_port` field's value and some
  NetworkPolicy admits it; Service target ports exist on the selected pods; the internal NetworkPolicy admits
  every internal service's port;
- terminationGracePeriodSeconds >= preStop sleep + the server's drain timeout + gRPC shutdown grace;
- expert servers advertise `$(POD_IP):<port>` from the downward API and know the control plane;
- the router finds attention pods by DNS: each attention name it is given is a headless Service
  (clusterIP None, so the name resolves to every ready pod) with that port, and it re-resolves
  (`discovery_interval_s` > 0);
- the expert pools start at least the expert servers the control plane waits for;
- the model volume is a PersistentVolumeClaim mounted read-only.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Callable

from deploy.render import pod_specs

Obj = dict[str, Any]
SERVICE_CONFIGS = {  # service -> config dataclass, as `moemesh serve` resolves them
    "router": "router_svc.config:RouterConfig",
    "attention": "attention_svc.config:AttentionConfig",
    "expert": "expert_svc.config:ExpertServerConfig",
    "control": "control_svc.config:ControlConfig",
}
INTERNAL = ("attention", "expert", "control")
MODEL_CLAIM = "moemesh-model"
ENV_RE = re.compile(r"^MOEMESH_([A-Z]+)_([A-Z0-9_]+)$")


def load_config_classes() -> dict[str, type]:
    """The four services' config classes (ImportError if one is missing)."""
    import importlib

    out = {}
    for service, spec in SERVICE_CONFIGS.items():
        module, _, attr = spec.partition(":")
        out[service] = getattr(importlib.import_module(module), attr)
    return out


def field_table(configs: dict[str, type]) -> dict[str, dict[str, Any]]:
    """service -> field name -> svc_config.FieldSpec."""
    from moemesh.svc_config import field_specs

    return {s: {f.name: f for f in field_specs(cls)} for s, cls in configs.items()}


# --- helpers ----------------------------------------------------------------------------------

def _name(o: Obj) -> str:
    return f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"


def _template_labels(o: Obj) -> dict[str, str]:
    return o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}) or {}


def _workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if pod_specs(o)]


def _selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against labels; empty selects all."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], e.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _containers(spec: Obj) -> list[Obj]:
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def service_of(container: Obj) -> str | None:
    """`moemesh serve <service>` -> service (from args, or command when it names moemesh)."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    if argv and argv[0] == "moemesh":
        argv = argv[1:]
    if len(argv) >= 2 and argv[0] == "serve":
        return argv[1]
    return None


def effective_env(container: Obj, objs: list[Obj]) -> dict[str, str]:
    """What the container's environment holds: envFrom ConfigMaps in order, then env (literal values)."""
    maps = {o["metadata"]["name"]: o.get("data", {}) or {} for o in objs if o.get("kind") == "ConfigMap"}
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref and ref.get("name") in maps:
            env.update({k: str(v) for k, v in maps[ref["name"]].items()})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "valueFrom" in e:
            env[e["name"]] = "<from " + ",".join(e["valueFrom"]) + ">"
    return env


def config_value(service: str, field: str, env: dict[str, str], fields: dict[str, dict[str, Any]]) -> Any:
    """The field's value as the service would read it from `env` (its default when unset or unreadable)."""
    from moemesh.svc_config import convert, env_name

    from moemesh.svc_config import ConfigValueError

    spec = fields[service][field]
    var = env_name(service, field)
    try:
        return convert(spec, env[var], f"env {var}") if var in env else spec.default
    except ConfigValueError:  # check_env_keys reports the value; other rules see the default
        return spec.default


def _grpc_port(container: Obj) -> int | None:
    for p in container.get("ports", []):
        if p.get("name") == "grpc":
            return p.get("containerPort")
    return None


# --- rules ------------------------------------------------------------------------------------

def check_probes(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        for c in pod_specs(o)[0].get("containers", []):
            port = _grpc_port(c)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p or "grpc" not in p:
                    out.append(f"{_name(o)} container {c['name']}: no gRPC {probe}")
                elif p["grpc"].get("port") != port:
                    out.append(f"{_name(o)} container {c['name']}: {probe} port {p['grpc'].get('port')} != gRPC port {port}")
    return out


def check_resources(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in _workloads(objs):
        for c in _containers(pod_specs(o)[0]):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in (res.get(kind) or {}):
                        out.append(f"{_name(o)} container {c['name']}: no {r} {kind[:-1]}")
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            if ("nvidia.com/gpu" in req or "nvidia.com/gpu" in lim) and str(req.get("nvidia.com/gpu")) != str(lim.get("nvidia.com/gpu")):
                out.append(f"{_name(o)} container {c['name']}: nvidia.com/gpu request != limit")
            device = next((e.get("value", "") for e in c.get("env", []) if e.get("name", "").endswith("_DEVICE")), "")
            if str(device).startswith("cuda") and int(str(lim.get("nvidia.com/gpu", "0"))) < 1:
                out.append(f"{_name(o)} container {c['name']}: computes on {device} without an nvidia.com/gpu limit")
    return out


def check_security(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in _workloads(objs):
        spec = pod_specs(o)[0]
        pod = spec.get("securityContext", {}) or {}
        for c in _containers(spec):
            sc = c.get("securityContext", {}) or {}
            where = f"{_name(o)} container {c['name']}"
            if not (sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True):
                out.append(f"{where}: runAsNonRoot is not true")
            if sc.get("runAsUser", pod.get("runAsUser")) == 0:
                out.append(f"{where}: runs as uid 0")
            if sc.get("readOnlyRootFilesystem") is not True:
                out.append(f"{where}: root filesystem is not read-only")
            if sc.get("allowPrivilegeEscalation") is not False:
                out.append(f"{where}: privilege escalation is not disabled")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                out.append(f"{where}: capabilities are not all dropped")
            if sc.get("privileged"):
                out.append(f"{where}: privileged")
    return out


def check_selectors(objs: list[Obj], **_) -> list[str]:
    out = []
    pods = [(o, _template_labels(o)) for o in _workloads(objs)]
    deployments = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "Deployment"}
    for o in objs:
        kind, spec = o.get("kind"), o.get("spec", {})
        if kind == "Deployment" and not _selects(spec.get("selector"), _template_labels(o)):
            out.append(f"{_name(o)}: selector does not match its pod labels")
        elif kind == "Service" and not any(_selects({"matchLabels": spec.get("selector", {})}, lab) for _, lab in pods):
            out.append(f"{_name(o)}: selects no pods")
        elif kind == "PodDisruptionBudget":
            hits = [w for w, lab in pods if w.get("kind") == "Deployment" and _selects(spec.get("selector"), lab)]
            if len(hits) != 1:
                out.append(f"{_name(o)}: selects {len(hits)} Deployments, want exactly 1")
        elif kind == "NetworkPolicy" and not any(_selects(spec.get("podSelector"), lab) for _, lab in pods):
            out.append(f"{_name(o)}: selects no pods")
        elif kind == "HorizontalPodAutoscaler":
            ref = spec.get("scaleTargetRef", {})
            if ref.get("kind") != "Deployment" or ref.get("name") not in deployments:
                out.append(f"{_name(o)}: targets no Deployment of these manifests ({ref})")
    return out


def check_pools(objs: list[Obj], **_) -> list[str]:
    out = []
    pdbs = [o for o in objs if o.get("kind") == "PodDisruptionBudget"]
    hpas = [o for o in objs if o.get("kind") == "HorizontalPodAutoscaler"]
    for o in objs:
        if o.get("kind") != "Deployment" or _template_labels(o).get("app.kubernetes.io/component") not in ("expert", "attention"):
            continue
        if not any(_selects(p["spec"].get("selector"), _template_labels(o)) for p in pdbs):
            out.append(f"{_name(o)}: no PodDisruptionBudget")
        if not any(h["spec"].get("scaleTargetRef", {}).get("name") == o["metadata"]["name"] for h in hpas):
            out.append(f"{_name(o)}: no HorizontalPodAutoscaler")
    return out


def check_env_keys(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    from moemesh.engine.device import device_format_error
    from moemesh.svc_config import ConfigValueError, convert

    out = []
    sources: list[tuple[str, str, str]] = []  # (where, key, value)
    for o in objs:
        if o.get("kind") == "ConfigMap":
            sources += [(_name(o), k, str(v)) for k, v in (o.get("data") or {}).items()]
        for spec in pod_specs(o):
            for c in _containers(spec):
                sources += [(f"{_name(o)} container {c['name']}", e["name"], str(e.get("value", ""))) for e in c.get("env", [])]
    for where, key, value in sources:
        if not key.startswith("MOEMESH_"):
            continue
        m = ENV_RE.match(key)
        service = m.group(1).lower() if m else None
        field = m.group(2).lower() if m else None
        if service not in fields:
            out.append(f"{where}: {key} names no service ({sorted(fields)})")
        elif field not in fields[service]:
            out.append(f"{where}: {key}: `moemesh serve {service}` has no field {field!r}")
        elif "$(" not in value:
            try:
                convert(fields[service][field], value, key)
            except ConfigValueError as e:
                out.append(f"{where}: {e}")
            if field == "device" and device_format_error(value):
                out.append(f"{where}: {key}: {device_format_error(value)}")
    return out


def check_ports(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    internal_ports: set[int] = set()
    metrics_ports: set[int] = set()
    for o in _workloads(objs):
        for c in pod_specs(o)[0].get("containers", []):
            service = service_of(c)
            if service is None:
                continue
            if service not in fields:
                out.append(f"{_name(o)}: `moemesh serve {service}` is not a service")
                continue
            env = effective_env(c, objs)
            port, host = config_value(service, "port", env, fields), config_value(service, "host", env, fields)
            if port != _grpc_port(c):
                out.append(f"{_name(o)}: {service} binds port {port} but declares gRPC port {_grpc_port(c)}")
            if host != "0.0.0.0":
                out.append(f"{_name(o)}: {service} binds {host!r}, unreachable from other pods")
            if service in INTERNAL:
                internal_ports.add(port)
            metrics = next((p.get("containerPort") for p in c.get("ports", []) if p.get("name") == "metrics"), None)
            if metrics is None and "metrics_port" in fields[service]:
                out.append(f"{_name(o)}: {service} declares no metrics port (Prometheus and the autoscalers see nothing)")
            if metrics is not None:
                metrics_ports.add(metrics)
                if "metrics_port" not in fields[service]:
                    out.append(f"{_name(o)}: declares a metrics port but `moemesh serve {service}` has no metrics_port field")
                elif config_value(service, "metrics_port", env, fields) != metrics:
                    out.append(f"{_name(o)}: {service} serves metrics on {config_value(service, 'metrics_port', env, fields)}, declares {metrics}")
    for o in objs:
        if o.get("kind") == "Service":
            selected = [w for w in _workloads(objs) if _selects({"matchLabels": o["spec"].get("selector", {})}, _template_labels(w))]
            declared = {(p.get("name"), p.get("containerPort")) for w in selected for c in pod_specs(w)[0].get("containers", []) for p in c.get("ports", [])}
            for sp in o["spec"].get("ports", []):
                t = sp.get("targetPort", sp.get("port"))
                if not any(t in (n, num) for n, num in declared):
                    out.append(f"{_name(o)}: targetPort {t!r} is on none of its pods")
    policies = [o for o in objs if o.get("kind") == "NetworkPolicy"]
    admitted = {p.get("port") for o in policies for rule in o["spec"].get("ingress", []) for p in rule.get("ports", [])}
    for port in sorted(internal_ports - admitted):
        out.append(f"NetworkPolicy: internal port {port} is admitted by no ingress rule")
    for port in sorted(metrics_ports - admitted):
        out.append(f"NetworkPolicy: metrics port {port} is admitted by no ingress rule (Prometheus cannot scrape)")
    return out


def check_drain(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        spec = pod_specs(o)[0]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        for c in spec.get("containers", []):
            service = service_of(c)
            if service not in fields:
                continue
            env = effective_env(c, objs)
            sleep = ((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0)
            need = sleep + config_value(service, "shutdown_grace_s", env, fields)
            if "drain_timeout_s" in fields[service]:
                need += config_value(service, "drain_timeout_s", env, fields)
            if grace < need:
                out.append(f"{_name(o)}: terminationGracePeriodSeconds {grace} < preStop + drain + shutdown grace = {need:g}")
    return out


def check_expert_registration(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    for o in _workloads(objs):
        for c in pod_specs(o)[0].get("containers", []):
            if service_of(c) != "expert":
                continue
            env_list = c.get("env", [])
            names = [e["name"] for e in env_list]
            pod_ip = next((i for i, e in enumerate(env_list) if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"), None)
            adv = next((i for i, e in enumerate(env_list) if e["name"] == "MOEMESH_EXPERT_ADVERTISE_ADDR"), None)
            if pod_ip is None or adv is None:
                out.append(f"{_name(o)}: expert does not advertise its pod IP (downward API status.podIP)")
                continue
            want = f"$({names[pod_ip]}):{_grpc_port(c)}"
            if env_list[adv].get("value") != want or adv < pod_ip:
                out.append(f"{_name(o)}: MOEMESH_EXPERT_ADVERTISE_ADDR should be {want!r}, defined after {names[pod_ip]}")
            if not config_value("expert", "control_addr", effective_env(c, objs), fields):
                out.append(f"{_name(o)}: expert server has no control plane address")
    return out


def check_expected_servers(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    """The first placement waits for `expected_expert_servers`: the pools must start at least that many."""
    if "expected_expert_servers" not in fields.get("control", {}):
        return []
    pods = sum(
        o["spec"].get("replicas", 1) for o in objs
        if o.get("kind") == "Deployment" and _template_labels(o).get("app.kubernetes.io/component") == "expert"
    )
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        for c in pod_specs(o)[0].get("containers", []):
            if service_of(c) == "control":
                want = config_value("control", "expected_expert_servers", effective_env(c, objs), fields)
                if want > pods:
                    out.append(f"{_name(o)}: waits for {want} expert servers, the pools start {pods}")
    return out


def check_model_volume(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        spec = pod_specs(o)[0]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        model = [n for n, v in vols.items() if (v.get("persistentVolumeClaim") or {}).get("claimName") == MODEL_CLAIM]
        if not model:
            out.append(f"{_name(o)}: does not mount the model volume ({MODEL_CLAIM})")
            continue
        if vols[model[0]]["persistentVolumeClaim"].get("readOnly") is not True:
            out.append(f"{_name(o)}: model claim is not readOnly")
        for c in _containers(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] in model and m.get("readOnly") is not True:
                    out.append(f"{_name(o)} container {c['name']}: model mounted read-write")
    return out


def check_attention_discovery(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    import ipaddress

    services = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "Service"}
    out = []
    for o in _workloads(objs):
        for c in _containers(pod_specs(o)[0]):
            if service_of(c) != "router":
                continue
            env = effective_env(c, objs)
            targets = [t.strip() for t in str(config_value("router", "attention", env, fields)).split(",") if t.strip()]
            names = []
            for target in targets:
                host, _, port = target.rpartition(":")
                try:
                    ipaddress.ip_address(host.strip("[]"))
                    continue
                except ValueError:
                    names.append(target)
                svc = services.get(host.split(".")[0])
                if svc is None or svc["spec"].get("clusterIP") != "None":
                    out.append(f"{_name(o)}: attention target {target!r} is not a headless Service (the router would see one replica)")
                elif not any(str(p.get("port")) == port for p in svc["spec"].get("ports", [])):
                    out.append(f"{_name(o)}: attention target {target!r}: Service {host} has no port {port}")
            if names and not config_value("router", "discovery_interval_s", env, fields) > 0:
                out.append(f"{_name(o)}: discovery_interval_s is 0: the router never sees attention pods added after it starts")
    return out


RULES: tuple[Callable[..., list[str]], ...] = (
    check_probes, check_resources, check_security, check_selectors, check_pools,
    check_env_keys, check_ports, check_drain, check_expert_registration, check_expected_servers, check_model_volume,
    check_attention_discovery,
)


def violations(objs: list[Obj], configs: dict[str, type] | None = None) -> list[str]:
    """Every rule's violations over the rendered objects `objs` (the services' configs by default)."""
    fields = field_table(configs if configs is not None else load_config_classes())
    return [v for rule in RULES for v in rule(objs, fields=fields)]


def main(argv: list[str] | None = None) -> int:
    from deploy.render import render

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m deploy.check KUSTOMIZATION_DIR...", file=sys.stderr)
        return 2
    bad = 0
    for d in args:
        for v in violations(render(d)):
            print(f"{d}: {v}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
