"""Render a kustomization offline: the subset of kustomize that `deploy/k8s` uses, nothing more.

    python -m deploy.render deploy/k8s/overlays/gpu      # prints the YAML `kubectl kustomize` would

Supported `kustomization.yaml` fields (anything else raises ValueError naming the field, so this
renderer never silently differs from kustomize):

- `resources`: YAML files (one or more documents) and directories holding a kustomization;
  a directory is rendered first, with its own fields, then this level's fields apply on top.
- `namespace`: set on every namespaced object (cluster-scoped kinds, e.g. Namespace, are left alone).
- `patches`: each `{path | patch, target?}`. A patch whose document is a list is JSON6902
  (`add`/`replace`/`remove`, JSON pointers); otherwise it is a strategic-merge patch: maps merge
  key by key (`null` deletes), lists of named things merge by their key (`containers`,
  `initContainers`, `env`, `volumes`: name; `volumeMounts`: mountPath; container ports:
  containerPort; service ports: port) with the patch's items first, as kustomize orders them;
  other lists are replaced. `target` selects by `kind`,
  `name` and `labelSelector` (`k=v,...`, `k!=v`); without it, the patch's own kind and name select.
- `images`: `{name, newName?, newTag?, digest?}` rewrites matching container images.
- `replicas`: `{name, count}` sets `spec.replicas`.
- `apiVersion`, `kind`: checked to be kustomize's.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "patches", "images", "replicas"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "PriorityClass", "StorageClass", "RuntimeClass", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration",
}
# kustomize's legacy output order; other kinds follow, by name
KIND_ORDER = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount", "PodSecurityPolicy",
    "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service",
    "LimitRange", "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment", "StatefulSet",
    "CronJob", "PodDisruptionBudget", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
]
Obj = dict[str, Any]


def load_yaml_docs(path: Path) -> list[Obj]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization_file(directory: Path) -> Path:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (directory / name).is_file():
            return directory / name
    raise ValueError(f"resources: {directory} holds no kustomization.yaml")


# --- strategic merge --------------------------------------------------------------------------

def _merge_key(field: str, items: list) -> str | None:
    if field in ("containers", "initContainers", "env", "volumes", "imagePullSecrets"):
        return "name"
    if field == "volumeMounts":
        return "mountPath"
    if field == "ports" and items and isinstance(items[0], dict):
        return "containerPort" if "containerPort" in items[0] else "port"
    return None


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` merged into a copy of `base` (see the module docstring for the rules)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        for k in patch:
            if isinstance(k, str) and k.startswith("$"):
                raise ValueError(f"patches: directive {k!r} is not supported by this renderer")
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, patch or base)
        if key is None:
            return copy.deepcopy(patch)
        by_key = {item.get(key): item for item in base if isinstance(item, dict)}
        out, patched = [], set()
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise ValueError(f"patches: every item of {field} must have {key!r}")
            k = item[key]
            out.append(strategic_merge(by_key[k], item, field) if k in by_key else copy.deepcopy(item))
            patched.add(k)
        # kustomize's order: the patch's items first, then the base's other items in their order
        out.extend(copy.deepcopy(item) for item in base if not (isinstance(item, dict) and item.get(key) in patched))
        return out
    return copy.deepcopy(patch)


# --- JSON6902 ---------------------------------------------------------------------------------

def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"patches: JSON pointer must start with '/', got {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json6902(obj: Obj, ops: list[Obj]) -> Obj:
    out = copy.deepcopy(obj)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        parent: Any = out
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if kind in ("add", "replace"):
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                if kind == "add":
                    parent.insert(len(parent) if last == "-" else int(last), value)
                else:
                    parent[int(last)] = value
            else:
                if kind == "replace" and last not in parent:
                    raise ValueError(f"patches: replace of missing path {op['path']}")
                parent[last] = value
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            else:
                del parent[last]
        else:
            raise ValueError(f"patches: JSON6902 op {kind!r} is not supported (add, replace, remove)")
    return out


# --- transformers -----------------------------------------------------------------------------

def _selects(obj: Obj, target: Obj) -> bool:
    for k in target:
        if k not in ("kind", "name", "labelSelector", "group", "version"):
            raise ValueError(f"patches: target field {k!r} is not supported")
    meta = obj.get("metadata", {})
    if "kind" in target and obj.get("kind") != target["kind"]:
        return False
    if "name" in target and meta.get("name") != target["name"]:
        return False
    if "labelSelector" in target:
        labels = meta.get("labels", {})
        for term in str(target["labelSelector"]).split(","):
            if "!=" in term:  # k!=v: objects without the label match too, as in Kubernetes
                k, _, v = term.partition("!=")
                if labels.get(k.strip()) == v.strip():
                    return False
                continue
            k, sep, v = term.partition("=")
            if not sep or labels.get(k.strip()) != v.strip():
                return False
    return True


def apply_patches(objs: list[Obj], patches: list[Obj], base_dir: Path) -> list[Obj]:
    for entry in patches:
        if "path" in entry:
            docs = load_yaml_docs(base_dir / entry["path"])
        elif "patch" in entry:
            docs = [d for d in yaml.safe_load_all(entry["patch"]) if d is not None]
        else:
            raise ValueError("patches: each entry needs `path` or `patch`")
        for doc in docs:
            target = entry.get("target")
            if target is None:
                if isinstance(doc, list):
                    raise ValueError("patches: a JSON6902 patch needs a target")
                target = {"kind": doc.get("kind"), "name": doc.get("metadata", {}).get("name")}
            hits = [i for i, o in enumerate(objs) if _selects(o, target)]
            if not hits:
                raise ValueError(f"patches: no resource matches target {target}")
            for i in hits:
                if isinstance(doc, list):
                    objs[i] = json6902(objs[i], doc)
                else:
                    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
                    meta = {k: v for k, v in doc.get("metadata", {}).items() if k not in ("name", "namespace")}
                    merged = strategic_merge(objs[i], body)
                    if meta:
                        merged["metadata"] = strategic_merge(merged["metadata"], meta)
                    objs[i] = merged
    return objs


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


def _split_image(image: str) -> tuple[str, str]:
    """(name, suffix) where suffix is ':tag', '@digest' or ''."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def apply_images(objs: list[Obj], images: list[Obj]) -> None:
    for obj in objs:
        for spec in pod_specs(obj):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, suffix = _split_image(c.get("image", ""))
                for rule in images:
                    unknown = set(rule) - {"name", "newName", "newTag", "digest"}
                    if unknown:
                        raise ValueError(f"images: fields {sorted(unknown)} are not supported")
                    if rule["name"] != name:
                        continue
                    new_name = rule.get("newName", name)
                    if "digest" in rule:
                        suffix = "@" + rule["digest"]
                    elif "newTag" in rule:
                        suffix = ":" + str(rule["newTag"])
                    c["image"] = new_name + suffix


def apply_replicas(objs: list[Obj], replicas: list[Obj]) -> None:
    for rule in replicas:
        hits = [o for o in objs if o.get("metadata", {}).get("name") == rule["name"] and "replicas" in o.get("spec", {})]
        if not hits:
            raise ValueError(f"replicas: no resource named {rule['name']!r} has spec.replicas")
        for o in hits:
            o["spec"]["replicas"] = int(rule["count"])


def render(directory: str | Path) -> list[Obj]:
    """The objects the kustomization in `directory` produces, in kustomize's legacy order."""
    d = Path(directory)
    kust = load_yaml_docs(kustomization_file(d))[0] or {}
    unknown = set(kust) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{d}: kustomization fields {sorted(unknown)} are not supported by deploy/render.py")
    if kust.get("kind", "Kustomization") != "Kustomization":
        raise ValueError(f"{d}: kind must be Kustomization")
    objs: list[Obj] = []
    for res in kust.get("resources", []):
        p = d / res
        objs.extend(render(p) if p.is_dir() else load_yaml_docs(p))
    seen = set()
    for o in objs:
        ident = (o.get("kind"), o.get("metadata", {}).get("namespace"), o.get("metadata", {}).get("name"))
        if ident in seen:
            raise ValueError(f"resources: {ident} is defined twice")
        seen.add(ident)
    objs = apply_patches(objs, kust.get("patches", []), d)
    apply_images(objs, kust.get("images", []))
    apply_replicas(objs, kust.get("replicas", []))
    if "namespace" in kust:
        for o in objs:
            if o.get("kind") not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = kust["namespace"]
    return sort_objects(objs)


def sort_objects(objs: list[Obj]) -> list[Obj]:
    def key(o: Obj):
        kind = o.get("kind", "")
        rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
        meta = o.get("metadata", {})
        return (rank, kind if rank == len(KIND_ORDER) else "", meta.get("namespace", ""), meta.get("name", ""))

    return sorted(objs, key=key)


def to_yaml(objs: list[Obj]) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=True, default_flow_style=False) for o in objs)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m deploy.render KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(to_yaml(render(args[0])))
    except (ValueError, OSError) as e:
        print(f"deploy/render: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
