"""Reading rendered manifests the way the services will: containers, their `moemesh serve` service,
the environment they end up with, and the config value each setting gives."""
from __future__ import annotations

import re
from typing import Any

Obj = dict[str, Any]
INTERNAL = ("attention", "expert", "control")
HTTP_SERVICES = ("gateway",)  # serve HTTP (port named `http`, HTTP probes), not gRPC
NO_MODEL = ("gateway",)  # read no model: need no model volume
MODEL_CLAIM = "moemesh-model"
ENV_RE = re.compile(r"^MOEMESH_([A-Z]+)_([A-Z0-9_]+)$")


def load_config_classes() -> dict[str, type]:
    """The services' config classes, from `moemesh serve`'s table of services (ImportError if one is missing)."""
    from moemesh.cli.serve import SERVICES, resolve

    return {service: resolve(config) for service, (config, _) in SERVICES.items()}


def field_table(configs: dict[str, type]) -> dict[str, dict[str, Any]]:
    """service -> field name -> svc_config.FieldSpec."""
    from moemesh.svc_config import field_specs

    return {s: {f.name: f for f in field_specs(cls)} for s, cls in configs.items()}


# --- helpers ----------------------------------------------------------------------------------

def pod_specs(obj: Obj) -> list[Obj]:
    """The pod specs inside a workload object (Deployment, StatefulSet, DaemonSet, Job, CronJob, Pod)."""
    kind, spec = obj.get("kind"), obj.get("spec", {})
    if kind == "Pod":
        return [spec]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [spec.get("template", {}).get("spec", {})]
    if kind == "CronJob":
        return [spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})]
    return []


def obj_name(o: Obj) -> str:
    return f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"


def template_labels_of(o: Obj) -> dict[str, str]:
    return o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}) or {}


def workloads_of(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if pod_specs(o)]


def selector_matches(selector: Obj | None, labels: dict[str, str]) -> bool:
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


def containers_of(spec: Obj) -> list[Obj]:
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


def grpc_port_of(container: Obj) -> int | None:
    return named_port_of(container, "grpc")


def named_port_of(container: Obj, name: str) -> int | None:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p.get("containerPort")
    return None


def serving_port_of(container: Obj) -> int | None:
    """The port the container's service binds: `http` for the HTTP services, `grpc` for the rest."""
    return named_port_of(container, "http" if service_of(container) in HTTP_SERVICES else "grpc")


# --- rules ------------------------------------------------------------------------------------
