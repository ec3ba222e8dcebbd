"""Failover on a running mesh: SIGKILL of an expert server while greedy streams run.

With replicas of every expert, the dead server's copies are simply dropped from the placement and
every request completes with the same tokens as `moemesh run`. Without replicas, its experts are
re-placed on the survivors (loaded from the checkpoint) and every request completes; when the
survivors have no room for them, requests end with UNAVAILABLE within the failover timeout, never
a hang."""
from __future__ import annotations

import time

import pytest

from tests.fixtures.services import run_json
from tests.live.mesh import LiveMesh, Workload, ctl, placement_servers

PROMPTS = [[9 + i, 60 + 5 * i, 200 + i, 3] for i in range(6)]
NEW_TOKENS = 12
FAILOVER_TIMEOUT_S = 6.0
# the heartbeat timeout is long, so the attention's report (probed by the control plane) is what
# detects a SIGKILLed server here; the heartbeat path is covered in tests/control_svc
CONTROL = {"expected_expert_servers": 3, "heartbeat_interval_s": 0.5, "dead_after_s": 20.0, "release_timeout_s": 5.0}


@pytest.fixture(scope="module")
def greedy(skewed_model):
    return [run_json("--model", str(skewed_model), "--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", str(NEW_TOKENS))["token_ids"]
            for p in PROMPTS]


def kill_during(mesh: LiveMesh, name: str, requests: int = 18):
    """Streams greedy requests, SIGKILLs expert child `name` once a few completed; returns the workload."""
    sid = mesh.server_id(name)
    w = Workload(mesh.router, PROMPTS, NEW_TOKENS, concurrency=3, max_requests=requests, timeout_s=60).start()
    try:
        w.wait_completed(3, 120)
        killed_at = time.monotonic()
        mesh.kill(name)
        st = mesh.wait_for(lambda st: sid not in placement_servers(st), 15, f"a placement without {sid}")
        replaced_s = time.monotonic() - killed_at
        w.wait_completed(requests, 180)
    finally:
        w.stop()
    return w, sid, st, replaced_s


@pytest.mark.parametrize("transport", ["grpc", "dist"])
def test_sigkill_with_replicas_every_request_completes(skewed_model, greedy, tmp_path, transport):
    mesh = LiveMesh(skewed_model, tmp_path, {**CONTROL, "redundant_experts": 16}, expert_flags={"transport": transport},
                    attention_flags={"failover_timeout_s": FAILOVER_TIMEOUT_S, "transport": transport})
    try:
        resp = ctl(mesh.control, "rebalance", "--force")  # 8 + 16 copies per layer: every expert on every server
        assert resp["switched"], resp
        st = mesh.status()
        assert all(len(e["server_ids"]) == 3 for layer in st["placement"]["layers"] for e in layer["experts"])
        w, sid, st, replaced_s = kill_during(mesh, "expert-proc-1")
        print(f"\nSIGKILL {sid} (replicas present, {transport}): placement without it after {replaced_s:.2f}s; "
              f"{len(w.results)} requests completed, {len(w.errors)} failed")
        assert w.errors == []
        assert [got for i, got in w.results] == [greedy[i] for i, _ in w.results]
        assert replaced_s < 10  # detected through the attention's report, well before dead_after_s
        states = {s["server"]["server_id"]: s["server"]["state"] for s in st["servers"]}
        assert states[sid] == "SERVER_STATE_DEAD"
    finally:
        mesh.stop()


def test_sigkill_without_replicas_replaces_then_unavailable_when_no_room(skewed_model, greedy, tmp_path):
    # 3 servers x 8 slots for 2 layers x 8 experts: one server's copies fit on the other two, two do not
    mesh = LiveMesh(skewed_model, tmp_path, CONTROL, expert_flags={"slot_budget": 8},
                    attention_flags={"failover_timeout_s": FAILOVER_TIMEOUT_S})
    try:
        st = mesh.status()
        assert all(len(e["server_ids"]) == 1 for layer in st["placement"]["layers"] for e in layer["experts"])
        w, sid, st, replaced_s = kill_during(mesh, "expert-proc-2")
        print(f"\nSIGKILL {sid} (no replicas): experts re-placed after {replaced_s:.2f}s; "
              f"{len(w.results)} requests completed, {len(w.errors)} failed")
        assert w.errors == []
        assert [got for i, got in w.results] == [greedy[i] for i, _ in w.results]
        assert len(placement_servers(st)) == 2

        # the last two servers cannot both go: the survivor has 8 slots for 16 experts
        mesh.kill("expert-proc-1")
        started = time.monotonic()
        w = Workload(mesh.router, PROMPTS, NEW_TOKENS, concurrency=2, max_requests=2, timeout_s=60).start()
        w.wait_completed(2, 60)
        w.stop()
        took = time.monotonic() - started
        print(f"no room left: {len(w.errors)} requests UNAVAILABLE after {took:.1f}s (failover timeout {FAILOVER_TIMEOUT_S}s)")
        assert len(w.errors) == 2 and all(e.startswith("UNAVAILABLE") for e in w.errors), w.errors
        assert took < FAILOVER_TIMEOUT_S + 15
    finally:
        mesh.stop()
