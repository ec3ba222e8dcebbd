import shutil
import subprocess
import textwrap

import pytest
import yaml

from deploy.render import render, strategic_merge, to_yaml
from tests.deploy.manifests import K8S, OVERLAYS, find, rendered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_and_matches_kubectl_when_present(overlay):
    objs = rendered(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "NetworkPolicy", "PersistentVolumeClaim"} <= kinds
    assert all(o["metadata"].get("namespace") == "moemesh" for o in objs if o["kind"] != "Namespace")
    kubectl = shutil.which("kubectl")
    if kubectl:  # the real kustomize must produce exactly the same objects, in the same order
        out = subprocess.run([kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120, check=True)
        assert [d for d in yaml.safe_load_all(out.stdout) if d] == objs
    assert [d for d in yaml.safe_load_all(to_yaml(objs)) if d] == objs


def test_overlays_set_images_replicas_and_gpu():
    gpu = rendered("overlays/gpu")
    experts_a = find(gpu, "Deployment", "experts-a")
    c = experts_a["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "registry.example.com/moemesh:0.1.0-cuda"
    assert experts_a["spec"]["replicas"] == 4
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert experts_a["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"name": "MOEMESH_EXPERT_DEVICE", "value": "cuda:0"} in c["env"]
    cpu = rendered("overlays/cpu-dev")
    router = find(cpu, "Deployment", "router")
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "moemesh:0.1.0-cpu"
    assert router["spec"]["template"]["spec"]["initContainers"][0]["name"] == "wait-for-model"
    assert router["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "100m"


def test_strategic_merge_rules():
    base = {"a": {"b": 1, "c": 2}, "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}], "args": [1, 2]}
    patch = {"a": {"c": None, "d": 4}, "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}], "args": [9]}
    assert strategic_merge(base, patch) == {
        "a": {"b": 1, "d": 4},
        "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}, {"name": "X", "value": "1"}],
        "args": [9],
    }
    assert base["env"][1]["value"] == "2"  # inputs untouched
    with pytest.raises(ValueError, match="directive"):
        strategic_merge(base, {"$patch": "replace"})


def write(tmp_path, name, text):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


DEPLOY = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, labels: {tier: front}}
spec:
  replicas: 1
  template:
    spec:
      containers:
        - {name: web, image: "reg:5000/web:1", ports: [{containerPort: 80}]}
"""


def test_json6902_images_replicas_namespace(tmp_path):
    write(tmp_path, "app.yaml", DEPLOY)
    write(tmp_path, "ns.yaml", "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n")
    write(tmp_path, "ops.yaml", """
        - {op: add, path: /spec/template/spec/containers/0/ports/-, value: {containerPort: 81}}
        - {op: replace, path: /metadata/labels/tier, value: back}
        - {op: remove, path: /spec/template/spec/containers/0/ports/0}
    """)
    write(tmp_path, "kustomization.yaml", """
        namespace: x
        resources: [app.yaml, ns.yaml]
        patches:
          - path: ops.yaml
            target: {kind: Deployment, labelSelector: tier=front}
        images:
          - {name: "reg:5000/web", newTag: "2"}
        replicas:
          - {name: web, count: 3}
    """)
    ns, web = render(tmp_path)
    assert ns == {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}
    assert web["metadata"] == {"name": "web", "labels": {"tier": "back"}, "namespace": "x"}
    c = web["spec"]["template"]["spec"]["containers"][0]
    assert c["ports"] == [{"containerPort": 81}] and c["image"] == "reg:5000/web:2"
    assert web["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    "kustomization, field",
    [
        ("resources: [app.yaml]\nnamePrefix: x-\n", "namePrefix"),
        ("resources: [app.yaml]\npatches:\n  - {path: p.yaml, target: {kind: Service}}\n", "patches"),
        ("resources: [app.yaml, app.yaml]\n", "resources"),
        ("resources: [app.yaml]\nreplicas: [{name: nope, count: 2}]\n", "replicas"),
        ("resources: [nowhere]\n", "resources"),
    ],
)
def test_unsupported_or_broken_kustomizations_name_the_field(tmp_path, kustomization, field):
    write(tmp_path, "app.yaml", DEPLOY)
    write(tmp_path, "p.yaml", "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec: {type: NodePort}\n")
    (tmp_path / "nowhere").mkdir()
    write(tmp_path, "kustomization.yaml", kustomization)
    with pytest.raises(ValueError, match=field):
        render(tmp_path)
