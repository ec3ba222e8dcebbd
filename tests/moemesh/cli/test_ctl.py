"""`moemesh ctl` rendering and errors (its calls against a live mesh are in tests/live)."""
from moemesh.cli.ctl import render, table
from moemesh.contracts.knobs import MoeKnobs
from moemesh.contracts.placement import Placement
from moemesh.contracts.wire import control_pb2, knobs_to_proto, placement_to_proto


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
