import os
import subprocess
import sys
from pathlib import Path

from moemesh.rpc import protos


def test_load_returns_message_and_service_modules():
    tensor_pb2, _ = protos.load("tensor")
    expert_pb2, expert_grpc = protos.load("expert")
    control_pb2, control_grpc = protos.load("control")
    t = tensor_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 24)
    assert expert_pb2.ForwardRequest(layer=1, x=t).x.shape == [2, 3]
    assert expert_pb2.DESCRIPTOR.package == "moemesh.v1"
    assert "ExpertService" in expert_pb2.DESCRIPTOR.services_by_name
    assert hasattr(expert_grpc, "ExpertServiceStub")
    assert hasattr(control_grpc, "add_ControlServiceServicer_to_server")
    assert control_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name == "moemesh.v1.ControlService"


def test_optional_fields_track_presence():
    control_pb2, _ = protos.load("control")
    hb = control_pb2.HeartbeatRequest(id="a")
    assert not hb.HasField("adopted_version")
    hb.adopted_version = 0
    assert hb.HasField("adopted_version")


def test_unknown_proto_name_is_a_clear_error():
    try:
        protos.load("no_such_proto")
    except protos.ProtoError as e:
        assert "no_such_proto" in str(e)
    else:
        raise AssertionError("expected ProtoError")


def test_proto_dir_override_in_a_fresh_process(tmp_path):
    """MOEMESH_PROTO_DIR names another proto root; a fresh process finds and imports the stubs."""
    root = tmp_path / "protos" / "moemesh" / "v1"
    root.mkdir(parents=True)
    for f in protos.proto_files(protos.proto_root()):
        (root / f.name).write_bytes(f.read_bytes())
    assert protos.sources_hash(protos.proto_files(tmp_path / "protos")) == protos.sources_hash(protos.proto_files(protos.proto_root()))
    code = "from moemesh.rpc.protos import load; print(load('expert')[0].ForwardRequest.DESCRIPTOR.full_name)"
    env = dict(os.environ, MOEMESH_PROTO_DIR=str(tmp_path / "protos"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=Path(protos.PACKAGE_DIR).parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "moemesh.v1.ForwardRequest"


def test_stale_stamp_regenerates(tmp_path):
    """A stamp that does not match the sources forces regeneration; stubs of removed protos go."""
    out = tmp_path / "_proto"
    protos.ensure_generated(out)
    good = (out / "STAMP").read_text()
    (out / "v1" / "removed_pb2.py").write_text("# a stub whose .proto no longer exists\n")
    (out / "v1" / "expert_pb2.py").write_text("garbage")
    protos.write_atomic(out / "STAMP", "stale")
    protos.ensure_generated(out)
    assert (out / "STAMP").read_text() == good
    assert not (out / "v1" / "removed_pb2.py").exists()
    compile((out / "v1" / "expert_pb2.py").read_text(), "expert_pb2.py", "exec")


def test_concurrent_processes_generate_once_into_a_fresh_dir(tmp_path):
    """Four processes race to generate into an empty dir: the lock serialises them, the stamp ends
    equal to the sources' hash, and every stub is complete Python."""
    out = tmp_path / "_proto"
    code = (
        "import sys; from pathlib import Path; from moemesh.rpc import protos; "
        "print(protos.ensure_generated(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=Path(protos.PACKAGE_DIR).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        assert stdout.strip() == str(out / "v1")
    files = protos.proto_files(protos.proto_root())
    assert (out / "STAMP").read_text() == protos.sources_hash(files)
    for f in files:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            text = (out / "v1" / f"{f.stem}{suffix}").read_text()
            compile(text, f.name, "exec")
            assert "from moemesh.v1 import" not in text  # rewritten to the generated package
    assert not list(out.glob(".gen-*"))  # temporary dirs are gone
