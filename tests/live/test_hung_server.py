"""An expert server that hangs (SIGSTOP) under load: the control plane declares it dead after
`dead_after_s` without a heartbeat and commits a placement without it; the attention replica fails
the calls still waiting on it over at once (not after the 60 s Forward timeout). Every stream waits
at most about dead_after_s + 1 s for its next token, no request fails, tokens are those of
`moemesh run`; resumed (SIGCONT), the server registers again and gets experts."""
from __future__ import annotations

import signal
import time

from tests.live.mesh import LiveMesh, Workload, ctl, placement_servers
from tests.live.test_failover import NEW_TOKENS, PROMPTS, greedy  # noqa: F401 - greedy is a fixture

DEAD_AFTER_S = 2.0
MARGIN_S = 4.0  # this machine's 2 cores are shared with other work: scheduling delays, not the mesh
CONTROL = {"expected_expert_servers": 2, "heartbeat_interval_s": 0.25, "dead_after_s": DEAD_AFTER_S, "release_timeout_s": 5.0,
           "redundant_experts": 8}


def test_streams_stall_at_most_the_dead_after_time_when_a_server_hangs(skewed_model, greedy, tmp_path):
    mesh = LiveMesh(skewed_model, tmp_path, CONTROL, attention_flags={"failover_timeout_s": 30.0})
    try:
        assert ctl(mesh.control, "rebalance", "--force")["switched"]  # every expert on both servers
        victim = mesh.server_id("expert-proc-1")
        w = Workload(mesh.router, PROMPTS, NEW_TOKENS, concurrency=3, max_requests=30, timeout_s=90).start()
        try:
            w.wait_completed(4, 120)
            before = w.longest_wait_s
            mesh.signal("expert-proc-1", signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                st = mesh.wait_for(lambda st: victim not in placement_servers(st), 30, f"a placement without {victim}")
                replaced_s = time.monotonic() - stopped_at
                done = w.completed()
                w.wait_completed(done + 6, 120)  # streams go on while it is stopped
            finally:
                mesh.signal("expert-proc-1", signal.SIGCONT)
            w.wait_completed(30, 240)
        finally:
            w.stop()
        back = mesh.wait_for(lambda st: any(s["server"]["address"] == mesh.experts["expert-proc-1"] and s["experts_held"] > 0
                                            and s["server"]["state"] == "SERVER_STATE_SERVING" for s in st["servers"]),
                             60, "the resumed server registered again with experts")
        print(f"\nSIGSTOP {victim}: declared dead and placed without after {replaced_s:.2f}s; longest wait of a stream "
              f"{w.longest_wait_s:.2f}s (before: {before:.2f}s); {len(w.results)} requests completed, {len(w.errors)} failed")
        assert w.errors == []
        assert [got for i, got in w.results] == [greedy[i] for i, _ in w.results]
        assert w.longest_wait_s < DEAD_AFTER_S + 1.0 + MARGIN_S
        assert {s["server"]["state"] for s in st["servers"] if s["server"]["server_id"] == victim} == {"SERVER_STATE_DEAD"}
        assert len(placement_servers(back)) >= 1
    finally:
        mesh.stop()
