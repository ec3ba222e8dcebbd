"""Policy rules on pods and objects: probes, resources, security context, selectors, pools, model volume."""
from __future__ import annotations

from deploy.manifest import (
    HTTP_SERVICES,
    MODEL_CLAIM,
    NO_MODEL,
    Obj,
    config_value,
    containers_of,
    effective_env,
    grpc_port_of,
    named_port_of,
    obj_name,
    service_of,
    pod_specs,
    selector_matches,
    service_of,
    template_labels_of,
    workloads_of,
)


def check_probes(objs: list[Obj], fields: dict | None = None, **_) -> list[str]:
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        for c in pod_specs(o)[0].get("containers", []):
            if service_of(c) in HTTP_SERVICES:
                out += http_probe_violations(o, c)
                continue
            port = grpc_port_of(c)
            service = service_of(c)
            if fields and service in fields and "health_port" in fields[service]:
                health = config_value(service, "health_port", effective_env(c, objs), fields)
                if health is not None:
                    port = health  # the plaintext health server (TLS on the gRPC port)
                    if not any(p.get("containerPort") == health for p in c.get("ports", [])):
                        out.append(f"{obj_name(o)} container {c['name']}: health port {health} is not declared")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if not p or "grpc" not in p:
                    out.append(f"{obj_name(o)} container {c['name']}: no gRPC {probe}")
                elif p["grpc"].get("port") != port:
                    out.append(f"{obj_name(o)} container {c['name']}: {probe} port {p['grpc'].get('port')} != gRPC port {port}")
    return out


def http_probe_violations(o: Obj, c: Obj) -> list[str]:
    """An HTTP service: HTTP probes on its `http` port, readiness on /health (503 while it cannot serve)."""
    out, port = [], named_port_of(c, "http")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if not p or "httpGet" not in p:
            out.append(f"{obj_name(o)} container {c['name']}: no HTTP {probe}")
        elif p["httpGet"].get("port") not in (port, "http"):
            out.append(f"{obj_name(o)} container {c['name']}: {probe} port {p['httpGet'].get('port')} != HTTP port {port}")
    ready = (c.get("readinessProbe") or {}).get("httpGet") or {}
    if ready and ready.get("path") != "/health":
        out.append(f"{obj_name(o)} container {c['name']}: readinessProbe path {ready.get('path')!r} is not /health")
    return out


def check_resources(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in workloads_of(objs):
        for c in containers_of(pod_specs(o)[0]):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in (res.get(kind) or {}):
                        out.append(f"{obj_name(o)} container {c['name']}: no {r} {kind[:-1]}")
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            if ("nvidia.com/gpu" in req or "nvidia.com/gpu" in lim) and str(req.get("nvidia.com/gpu")) != str(lim.get("nvidia.com/gpu")):
                out.append(f"{obj_name(o)} container {c['name']}: nvidia.com/gpu request != limit")
            device = next((e.get("value", "") for e in c.get("env", []) if e.get("name", "").endswith("_DEVICE")), "")
            if str(device).startswith("cuda") and int(str(lim.get("nvidia.com/gpu", "0"))) < 1:
                out.append(f"{obj_name(o)} container {c['name']}: computes on {device} without an nvidia.com/gpu limit")
    return out


def check_security(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in workloads_of(objs):
        spec = pod_specs(o)[0]
        pod = spec.get("securityContext", {}) or {}
        for c in containers_of(spec):
            sc = c.get("securityContext", {}) or {}
            where = f"{obj_name(o)} container {c['name']}"
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
    pods = [(o, template_labels_of(o)) for o in workloads_of(objs)]
    deployments = {o["metadata"]["name"]: o for o in objs if o.get("kind") == "Deployment"}
    for o in objs:
        kind, spec = o.get("kind"), o.get("spec", {})
        if kind == "Deployment" and not selector_matches(spec.get("selector"), template_labels_of(o)):
            out.append(f"{obj_name(o)}: selector does not match its pod labels")
        elif kind == "Service" and not any(selector_matches({"matchLabels": spec.get("selector", {})}, lab) for _, lab in pods):
            out.append(f"{obj_name(o)}: selects no pods")
        elif kind == "PodDisruptionBudget":
            hits = [w for w, lab in pods if w.get("kind") == "Deployment" and selector_matches(spec.get("selector"), lab)]
            if len(hits) != 1:
                out.append(f"{obj_name(o)}: selects {len(hits)} Deployments, want exactly 1")
        elif kind == "NetworkPolicy" and not any(selector_matches(spec.get("podSelector"), lab) for _, lab in pods):
            out.append(f"{obj_name(o)}: selects no pods")
        elif kind == "HorizontalPodAutoscaler":
            ref = spec.get("scaleTargetRef", {})
            if ref.get("kind") != "Deployment" or ref.get("name") not in deployments:
                out.append(f"{obj_name(o)}: targets no Deployment of these manifests ({ref})")
    return out


def check_pools(objs: list[Obj], **_) -> list[str]:
    out = []
    pdbs = [o for o in objs if o.get("kind") == "PodDisruptionBudget"]
    hpas = [o for o in objs if o.get("kind") == "HorizontalPodAutoscaler"]
    for o in objs:
        if o.get("kind") != "Deployment" or template_labels_of(o).get("app.kubernetes.io/component") not in ("expert", "attention", "gateway"):
            continue
        if not any(selector_matches(p["spec"].get("selector"), template_labels_of(o)) for p in pdbs):
            out.append(f"{obj_name(o)}: no PodDisruptionBudget")
        if not any(h["spec"].get("scaleTargetRef", {}).get("name") == o["metadata"]["name"] for h in hpas):
            out.append(f"{obj_name(o)}: no HorizontalPodAutoscaler")
    return out



def check_model_volume(objs: list[Obj], **_) -> list[str]:
    out = []
    for o in objs:
        if o.get("kind") != "Deployment":
            continue
        spec = pod_specs(o)[0]
        if spec.get("containers") and all(service_of(c) in NO_MODEL for c in spec["containers"]):
            continue
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        model = [n for n, v in vols.items() if (v.get("persistentVolumeClaim") or {}).get("claimName") == MODEL_CLAIM]
        if not model:
            out.append(f"{obj_name(o)}: does not mount the model volume ({MODEL_CLAIM})")
            continue
        if vols[model[0]]["persistentVolumeClaim"].get("readOnly") is not True:
            out.append(f"{obj_name(o)}: model claim is not readOnly")
        for c in containers_of(spec):
            for m in c.get("volumeMounts", []):
                if m["name"] in model and m.get("readOnly") is not True:
                    out.append(f"{obj_name(o)} container {c['name']}: model mounted read-write")
    return out
