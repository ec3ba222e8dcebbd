"""`moemesh ctl` rendering and errors (its calls against a live mesh are in tests/live)."""
from moemesh.cli.ctl import render, table
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import control_pb2, knobs_to_proto, placement_to_proto
from tests.fixtures.expert_servers import loop  # noqa: F401  (a pytest fixture)


def test_status_table_lists_servers_and_replicas():
    resp = control_pb2.StatusResponse(
        placement_version=4, balancedness=0.875, window_tokens=1200, knobs=knobs_to_proto(MoeKnobs(top_k=1)),
        servers=[control_pb2.ExpertServerStatus(
            server=control_pb2.ExpertServerInfo(server_id="expert-0", address="127.0.0.1:5", device="cpu",
                                                state=control_pb2.SERVER_STATE_DRAINING),
            experts_held=6, window_tokens=900, queue_depth=2, busy_seconds=1.5)],
        replicas=[control_pb2.AttentionReplicaStatus(replica_id="attention-0", address="127.0.0.1:6", adopted_version=4, alive=True)],
    )
    text = render("status", resp)
    assert "placement v4  balancedness 0.875  window tokens 1200" in text
    assert "top_k=1" in text
    row = next(line for line in text.splitlines() if line.startswith("expert-0"))
    assert row.split()[:8] == ["expert-0", "127.0.0.1:5", "draining", "cpu", "6", "900", "2", "1.50"]
    assert "none" in row  # no GPU
    assert any(line.startswith("attention-0") and "v4" in line for line in text.splitlines())


def test_placement_and_rebalance_rendering():
    update = control_pb2.PlacementUpdate(placement=placement_to_proto(Placement(3, {0: (("a",), ("a", "b"))})))
    assert render("placement", update).splitlines()[2:] == ["0      0       a", "0      1       a,b"]
    kept = control_pb2.RebalanceResponse(switched=False, placement_version=3, balancedness_before=0.9, balancedness_after=0.92,
                                         reason="balancedness gain 0.020 is below min_gain 0.05")
    assert render("rebalance", kept).startswith("kept placement v3: balancedness gain")


def test_unreachable_control_plane_is_a_clear_error(capsys):
    from moemesh.cli.main import main

    assert main(["ctl", "--addr", "127.0.0.1:1", "--timeout", "2", "status"]) == 1
    assert "moemesh ctl status: error: UNAVAILABLE" in capsys.readouterr().err


def test_table_pads_columns():
    assert table(["A", "LONG"], [[1, 2], [333, 4]]).splitlines() == ["A    LONG", "1    2", "333  4"]


def test_rebalance_dry_run_against_a_live_control_plane(tiny_model_dir, loop, capsys, monkeypatch):
    """A control plane and two expert servers (in this process, over gRPC), load on the first
    server's experts: `ctl rebalance --dry-run` prints the plan's predicted gain and cost, calibrated
    from the servers' reports, and switches nothing; `ctl set --top-k 1 --dry-run` likewise."""
    import json
    import time

    import torch

    from control_svc.config import ControlConfig
    from control_svc.server import create_server
    from moemesh.cli.main import main
    from moemesh.transport.base import ExpertRequest
    from tests.fixtures.expert_servers import HIDDEN, running_expert_servers
    from tests.fixtures.auth import TEST_RPC, TEST_TOKEN

    monkeypatch.setenv("MOEMESH_MESH_TOKEN", TEST_TOKEN)
    cfg = ControlConfig(model_dir=str(tiny_model_dir), expected_expert_servers=2, heartbeat_interval_s=0.1, dead_after_s=5.0,
                        rebalance_min_tokens=10, redundant_experts=2, rpc=TEST_RPC)
    control, _ = loop.run(create_server(cfg), 30)
    loop.run(control.start(), 30)
    try:
        with running_expert_servers(tiny_model_dir, 2, loop, transport="grpc", control_addr=control.address) as (hot, cold):
            loop.run(control.plane.wait_placed(20), 30)
            deadline = time.monotonic() + 20
            while not (hot.shard.held() and cold.shard.held()):
                assert time.monotonic() < deadline, "the initial placement was not loaded"
                time.sleep(0.05)
            for srv, rows in ((hot, 24), (cold, 1)):  # the first server's experts get most of the rows
                for layer, held in srv.shard.held().items():
                    g = len(held)
                    req = ExpertRequest(layer, 1, torch.randn(rows, HIDDEN), torch.arange(rows, dtype=torch.int32).repeat(g),
                                        torch.rand(rows * g), torch.tensor(held, dtype=torch.int64), torch.full((g,), rows, dtype=torch.int64))
                    for _ in range(30):
                        srv.shard.forward(req)
            while control.plane.cost_inputs(control.plane.board.current).costs.calibrated is False or control.plane.load().sum() < 1000:
                assert time.monotonic() < deadline, "the heartbeats did not carry the load"
                time.sleep(0.05)
            capsys.readouterr()
            assert main(["ctl", "--addr", control.address, "rebalance", "--dry-run"]) == 0
            text = capsys.readouterr().out
            assert text.startswith("dry run on placement v1: ")
            assert "predicted step" in text and "calibrated from the expert servers" in text and "MB" in text
            assert main(["ctl", "--addr", control.address, "--json", "rebalance", "--dry-run"]) == 0
            resp = json.loads(capsys.readouterr().out)
            assert resp["dry_run"] is True and resp["switched"] is False and resp["calibrated"] is True
            assert resp["predicted_gain"] > 0 and resp["step_ms_before"] > 0 and int(resp["placement_version"]) == 1
            assert main(["ctl", "--addr", control.address, "set", "--top-k", "1", "--dry-run"]) == 0
            text = capsys.readouterr().out
            assert "would carry knobs: top_k=1" in text and "predicted step" in text
            assert control.plane.board.version == 1 and control.plane.board.current.knobs.top_k is None
    finally:
        loop.run(control.shutdown(0.2), 30)
