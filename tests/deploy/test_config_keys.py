"""The manifests and the local launcher (`moemesh up`) speak the services' own configuration keys."""
import pytest

from deploy.check import effective_env, load_config_classes, service_of
from deploy.manifest import pod_specs
from moemesh.svc_config import env_name, field_specs
from tests.deploy.manifests import OVERLAYS, rendered


@pytest.fixture(scope="module")
def fields():
    return {s: {f.name for f in field_specs(cls)} for s, cls in load_config_classes().items()}


def manifest_keys(objs) -> dict[str, set[str]]:
    """service -> MOEMESH_ keys its `moemesh serve` containers receive (ConfigMaps via envFrom, env)."""
    out: dict[str, set[str]] = {}
    for o in objs:
        for spec in pod_specs(o):
            for c in spec.get("containers", []):
                service = service_of(c)
                if service:
                    out.setdefault(service, set()).update(k for k in effective_env(c, objs) if k.startswith("MOEMESH_"))
    return out


def launcher_flags(monkeypatch) -> dict[str, set[str]]:
    """service -> config fields `moemesh up` passes as flags (its children captured, not started)."""
    import moemesh.launcher.mesh as mesh

    started: list[list[str]] = []

    class FakeChild:
        def __init__(self, name, argv, log_path, env=None):
            self.name, self.argv = name, argv
            started.append(argv)

        def poll(self):
            return None

        def log_tail(self, lines=20):
            return ""

    monkeypatch.setattr(mesh, "Child", FakeChild)
    monkeypatch.setattr(mesh, "wait_serving", lambda *a, **k: None)
    monkeypatch.setattr(mesh, "wait_http_ok", lambda *a, **k: None)
    monkeypatch.setattr(mesh, "stop_all", lambda *a, **k: None)
    mesh.Mesh(mesh.MeshSpec(model_dir="/models/model", expert_servers=2, attention_replicas=2, http_port=0), "/tmp/moemesh-keys-test").start()
    out: dict[str, set[str]] = {}
    for argv in started:
        i = argv.index("serve")
        service, flags = argv[i + 1], argv[i + 2:]
        out.setdefault(service, set()).update(f[2:].replace("-", "_") for f in flags if f.startswith("--"))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_key_is_accepted_by_its_service(overlay, fields):
    keys = manifest_keys(rendered(overlay))
    assert set(keys) == {"router", "attention", "expert", "control", "gateway"}
    for service, names in keys.items():
        accepted = {env_name(s, f) for s in fields for f in fields[s]}
        assert names <= accepted, sorted(names - accepted)
        own = {n for n in names if n.startswith(f"MOEMESH_{service.upper()}_")}
        assert own, f"{service} containers get none of their own keys"


def test_launcher_passes_only_accepted_flags(monkeypatch, fields):
    flags = launcher_flags(monkeypatch)
    assert set(flags) == {"router", "attention", "expert", "control", "gateway"}
    for service, names in flags.items():
        assert names <= fields[service], f"moemesh up passes {sorted(names - fields[service])} to {service}"


def test_manifests_set_every_key_the_launcher_sets(monkeypatch):
    flags = launcher_flags(monkeypatch)
    for overlay in OVERLAYS:
        keys = manifest_keys(rendered(overlay))
        for service, names in flags.items():
            missing = {env_name(service, n) for n in names} - keys[service]
            assert not missing, f"{overlay}: {service} is started by `moemesh up` with {sorted(missing)}, the manifests do not set them"
