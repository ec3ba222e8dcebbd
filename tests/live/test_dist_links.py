"""The torch.distributed transport across live placement changes: attention and expert servers on
gloo links (frames, no gRPC per call) while a server joins and another is stopped with SIGTERM
(its own drain: the control plane moves its experts away, the attention closes its links, it
exits 0). Every greedy request completes with the tokens of `moemesh run`."""
from __future__ import annotations

import pytest

from tests.live.mesh import LiveMesh, placement_servers
from tests.live.test_switching import assert_all_equal, greedy, run_during  # noqa: F401 - greedy is a fixture


@pytest.fixture(scope="module")
def mesh(skewed_model, tmp_path_factory):
    m = LiveMesh(skewed_model, tmp_path_factory.mktemp("dist-logs"), {
        "expected_expert_servers": 2, "heartbeat_interval_s": 0.2, "dead_after_s": 3.0, "redundant_experts": 2,
        "release_timeout_s": 10.0,
    }, expert_flags={"transport": "dist"}, attention_flags={"transport": "dist"})
    yield m
    m.stop()


def test_dist_links_follow_a_join_and_a_sigterm_drain_with_no_failed_request(mesh, greedy):
    w, joined = run_during(mesh, mesh.join_expert)
    print(f"\ndist join: {joined} holds experts; {len(w.results)} requests, {len(w.errors)} failed")
    assert_all_equal(w, greedy)

    victim = mesh.server_id("expert-proc-0")

    def stop():
        rc = mesh.terminate("expert-proc-0")
        return rc, mesh.wait_for(lambda st: victim not in placement_servers(st), 30, f"{victim} out of the placement")

    w, (rc, st) = run_during(mesh, stop)
    print(f"dist SIGTERM: {victim} exited {rc}, placement v{st['placement_version']}; {len(w.results)} requests, {len(w.errors)} failed")
    assert rc == 0
    assert_all_equal(w, greedy)
