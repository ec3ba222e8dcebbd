"""A control plane restarted under load (SIGKILL, then the same command line: a new process that
knows nothing), then an expert server SIGKILLed: the expert servers and the attention replica
register again, the new control plane rebuilds the placement they run (numbered above what they
report, so the replica adopts it), and the failover of the killed server works as before: every
greedy request completes with the tokens of `moemesh run`."""
from __future__ import annotations

import time

from tests.live.mesh import LiveMesh, Workload, ctl, placement_servers
from tests.live.test_failover import NEW_TOKENS, PROMPTS, greedy  # noqa: F401 - greedy is a fixture

CONTROL = {"expected_expert_servers": 2, "heartbeat_interval_s": 0.5, "dead_after_s": 20.0, "release_timeout_s": 5.0,
           "redundant_experts": 8}


def copies(st: dict) -> dict[int, list[set[str]]]:
    return {layer.get("layer", 0): [set(e["server_ids"]) for e in layer["experts"]] for layer in st["placement"]["layers"]}


def test_failover_works_after_a_control_plane_restart(skewed_model, greedy, tmp_path):
    mesh = LiveMesh(skewed_model, tmp_path, CONTROL, attention_flags={"failover_timeout_s": 20.0})
    try:
        assert ctl(mesh.control, "rebalance", "--force")["switched"]  # 8 + 8 copies per layer: every expert on both servers
        before = mesh.status()
        assert all(len(e["server_ids"]) == 2 for layer in before["placement"]["layers"] for e in layer["experts"])
        ids = sorted(placement_servers(before))
        w = Workload(mesh.router, PROMPTS, NEW_TOKENS, concurrency=3, max_requests=400, timeout_s=90).start()
        try:
            w.wait_completed(3, 120)
            restarted_at = time.monotonic()
            mesh.restart("control", mesh.control)
            st = mesh.wait_for(
                lambda st: int(st["placement_version"]) > int(before["placement_version"]) and st["replicas"]  # uint64: strings in JSON
                and all(int(r.get("adopted_version", 0)) == int(st["placement_version"]) for r in st["replicas"] if r["alive"]),
                60, "a rebuilt placement that the replica runs")
            rebuilt_s = time.monotonic() - restarted_at
            assert copies(st) == copies(before)  # the same servers (same ids) hold the same copies
            done = w.completed()
            w.wait_completed(done + 3, 120)
            mesh.kill("expert-proc-1")
            victim = next(s["server"]["server_id"] for s in st["servers"] if s["server"]["address"] == mesh.experts["expert-proc-1"])
            killed = w.completed()
            after = mesh.wait_for(lambda st: victim not in placement_servers(st), 30, f"a placement without {victim}")
            w.wait_completed(killed + 12, 240)
        finally:
            w.stop()
        print(f"\ncontrol plane restarted: placement v{before['placement_version']} rebuilt as v{st['placement_version']} "
              f"after {rebuilt_s:.1f}s; then SIGKILL {victim}: {len(w.results)} requests completed, {len(w.errors)} failed")
        assert w.errors == []
        assert [got for i, got in w.results] == [greedy[i] for i, _ in w.results]
        assert placement_servers(after) == set(ids) - {victim}
    finally:
        mesh.stop()
