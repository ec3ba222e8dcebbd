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
    """A wrong stamp forces regeneration (under the lock) and the stamp is rewritten to the hash."""
    stamp = protos.OUT_DIR / "STAMP"
    protos.ensure_generated()
    good = stamp.read_text()
    protos.write_atomic(stamp, "stale")
    try:
        protos.ensure_generated()
        assert stamp.read_text() == good
    finally:
        if stamp.read_text() != good:
            protos.write_atomic(stamp, good)
