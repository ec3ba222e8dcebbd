"""The base and its overlays, as `kubectl kustomize` renders them: every object in the namespace, and what
each overlay changes (images, replicas, GPUs, the demo model's wait)."""
import pytest

from tests.deploy.manifests import OVERLAYS, find, rendered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_the_whole_mesh_in_its_namespace(overlay):
    objs = rendered(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "NetworkPolicy", "PersistentVolumeClaim"} <= kinds
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Deployment"} >= {
        "router", "attention", "experts-a", "experts-b", "control"}
    assert all(o["metadata"].get("namespace") == "moemesh" for o in objs if o["kind"] != "Namespace")


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
    assert find(cpu, "Job", "demo-model")["metadata"]["namespace"] == "moemesh"
