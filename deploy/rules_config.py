"""Policy rules on the services' settings: config keys, ports, drain timing, registration, expected servers, discovery."""
from __future__ import annotations

from typing import Any

from deploy.manifest import (
    ENV_RE,
    HTTP_SERVICES,
    Obj,
    config_value,
    containers_of,
    effective_env,
    grpc_port_of,
    obj_name,
    pod_specs,
    selector_matches,
    service_of,
    serving_port_of,
    template_labels_of,
    workloads_of,
)


def check_env_keys(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    from moemesh.engine.device import device_format_error
    from moemesh.svc_config import ConfigValueError, convert

    out = []
    sources: list[tuple[str, str, str]] = []  # (where, key, value)
    for o in objs:
        if o.get("kind") == "ConfigMap":
            sources += [(obj_name(o), k, str(v)) for k, v in (o.get("data") or {}).items()]
        for spec in pod_specs(o):
            for c in containers_of(spec):
                sources += [(f"{obj_name(o)} container {c['name']}", e["name"], str(e.get("value", ""))) for e in c.get("env", [])]
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
    metrics_ports: set[int] = set()
    for o in workloads_of(objs):
        for c in pod_specs(o)[0].get("containers", []):
            service = service_of(c)
            if service is None:
                continue
            if service not in fields:
                out.append(f"{obj_name(o)}: `moemesh serve {service}` is not a service")
                continue
            env = effective_env(c, objs)
            port, host = config_value(service, "port", env, fields), config_value(service, "host", env, fields)
            if port != serving_port_of(c):
                kind = "HTTP" if service in HTTP_SERVICES else "gRPC"
                out.append(f"{obj_name(o)}: {service} binds port {port} but declares {kind} port {serving_port_of(c)}")
            if host != "0.0.0.0":
                out.append(f"{obj_name(o)}: {service} binds {host!r}, unreachable from other pods")
            metrics = next((p.get("containerPort") for p in c.get("ports", []) if p.get("name") == "metrics"), None)
            if metrics is None and "metrics_port" in fields[service]:
                out.append(f"{obj_name(o)}: {service} declares no metrics port (Prometheus and the autoscalers see nothing)")
            if metrics is not None:
                metrics_ports.add(metrics)
                if "metrics_port" not in fields[service]:
                    out.append(f"{obj_name(o)}: declares a metrics port but `moemesh serve {service}` has no metrics_port field")
                elif config_value(service, "metrics_port", env, fields) != metrics:
                    out.append(f"{obj_name(o)}: {service} serves metrics on {config_value(service, 'metrics_port', env, fields)}, declares {metrics}")
    for o in objs:
        if o.get("kind") == "Service":
            selected = [w for w in workloads_of(objs) if selector_matches({"matchLabels": o["spec"].get("selector", {})}, template_labels_of(w))]
            declared = {(p.get("name"), p.get("containerPort")) for w in selected for c in pod_specs(w)[0].get("containers", []) for p in c.get("ports", [])}
            for sp in o["spec"].get("ports", []):
                t = sp.get("targetPort", sp.get("port"))
                if not any(t in (n, num) for n, num in declared):
                    out.append(f"{obj_name(o)}: targetPort {t!r} is on none of its pods")
    policies = [o for o in objs if o.get("kind") == "NetworkPolicy"]
    admitted = {p.get("port") for o in policies for rule in o["spec"].get("ingress", []) for p in rule.get("ports", [])}
    # who may reach each internal port: rules_security.check_network_policies
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
                out.append(f"{obj_name(o)}: terminationGracePeriodSeconds {grace} < preStop + drain + shutdown grace = {need:g}")
    return out


def check_expert_registration(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    out = []
    for o in workloads_of(objs):
        for c in pod_specs(o)[0].get("containers", []):
            if service_of(c) != "expert":
                continue
            env_list = c.get("env", [])
            names = [e["name"] for e in env_list]
            pod_ip = next((i for i, e in enumerate(env_list) if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP"), None)
            adv = next((i for i, e in enumerate(env_list) if e["name"] == "MOEMESH_EXPERT_ADVERTISE_ADDR"), None)
            if pod_ip is None or adv is None:
                out.append(f"{obj_name(o)}: expert does not advertise its pod IP (downward API status.podIP)")
                continue
            want = f"$({names[pod_ip]}):{grpc_port_of(c)}"
            if env_list[adv].get("value") != want or adv < pod_ip:
                out.append(f"{obj_name(o)}: MOEMESH_EXPERT_ADVERTISE_ADDR should be {want!r}, defined after {names[pod_ip]}")
            if not config_value("expert", "control_addr", effective_env(c, objs), fields):
                out.append(f"{obj_name(o)}: expert server has no control plane address")
    return out


def check_expected_servers(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    """The first placement waits for `expected_expert_servers`: the pools must start at least that many."""
    if "expected_expert_servers" not in fields.get("control", {}):
        return []
    pods = sum(
        o["spec"].get("replicas", 1) for o in objs
        if o.get("kind") == "Deployment" and template_labels_of(o).get("app.kubernetes.io/component") == "expert"
    )
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        for c in pod_specs(o)[0].get("containers", []):
            if service_of(c) == "control":
                want = config_value("control", "expected_expert_servers", effective_env(c, objs), fields)
                if want > pods:
                    out.append(f"{obj_name(o)}: waits for {want} expert servers, the pools start {pods}")
    return out



def check_attention_discovery(objs: list[Obj], fields: dict[str, dict[str, Any]], **_) -> list[str]:
    import ipaddress

    services = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "Service"}
    out = []
    for o in workloads_of(objs):
        for c in containers_of(pod_specs(o)[0]):
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
                    out.append(f"{obj_name(o)}: attention target {target!r} is not a headless Service (the router would see one replica)")
                elif not any(str(p.get("port")) == port for p in svc["spec"].get("ports", [])):
                    out.append(f"{obj_name(o)}: attention target {target!r}: Service {host} has no port {port}")
            if names and not config_value("router", "discovery_interval_s", env, fields) > 0:
                out.append(f"{obj_name(o)}: discovery_interval_s is 0: the router never sees attention pods added after it starts")
    return out
