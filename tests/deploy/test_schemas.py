import kubernetes_validate
import pytest

from tests.deploy.manifests import OVERLAYS, find, rendered

# 1.30 is the oldest Kubernetes these manifests support (preStop `sleep` action); also the newest schemas bundled
VERSIONS = ("1.30", kubernetes_validate.latest_version())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay, version):
    for obj in rendered(overlay):
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD: no schema bundled (its fields are checked in test_policy)
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["spec"]["template"]["spec"]["containers"][0].update(livenessprobe={}),  # misspelt field
        lambda o: o["spec"].update(replicas="two"),
        lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("name"),
    ],
)
def test_strict_validation_catches_mistakes(mutate):
    obj = find(rendered("base"), "Deployment", "router")
    mutate(obj)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, VERSIONS[0], strict=True)
