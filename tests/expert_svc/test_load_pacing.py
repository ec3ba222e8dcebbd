"""Loads and drops while serving: the pacer's pauses (pure) and the servicer taking them between
layers, reporting its changing seconds without them."""
import math
import time
from dataclasses import dataclass, field

import pytest

from expert_svc.config import ExpertServerConfig
from expert_svc.load_pacing import LoadPacer, cpu_timed
from moemesh.rpc.protos import load
from moemesh.transport.grpc_transport import request_message
from tests.fixtures.expert_servers import routed_request, running_expert_servers
from tests.expert_svc.test_server import call, stream
from tests.fixtures.auth import TEST_RPC

expert_pb2, _ = load("expert")


def test_a_change_while_serving_takes_at_most_its_share_of_the_cpus():
    pacer = LoadPacer(cpus=0.5, share=0.2)  # changes may use 0.1 CPU while serving
    # 20 ms of CPU over 25 ms: the change and its pause span 200 ms
    assert pacer.pause(0.020, 0.025, since_call_s=0.1) == pytest.approx(0.175)
    assert pacer.pause(0.020, 0.5, since_call_s=0.1) == 0.0  # slow enough already
    assert pacer.pause(0.020, 0.025, since_call_s=5.0) == 0.0  # idle: full speed
    assert pacer.pause(0.020, 0.025, since_call_s=math.inf) == 0.0  # no call yet
    assert LoadPacer(cpus=0.5, share=1.0).pause(0.020, 0.025, 0.1) == 0.0


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, float("nan")])
def test_a_bad_share_is_refused_naming_the_field(share):
    with pytest.raises(ValueError, match="load_cpu_share"):
        LoadPacer(cpus=1.0, share=share)
    with pytest.raises(ValueError, match="load_cpu_share"):
        ExpertServerConfig(model_dir="m", load_cpu_share=share, rpc=TEST_RPC)


def test_cpu_timed_returns_the_result_and_the_cpu_it_took():
    def spin(n):
        end = time.thread_time() + n
        while time.thread_time() < end:
            pass
        return "done"

    out, cpu_s = cpu_timed(spin)(0.02)
    assert out == "done" and 0.02 <= cpu_s < 1.0 and cpu_timed(spin).__name__ == "spin"


@dataclass(frozen=True)
class Recording(LoadPacer):
    """Pauses `wait` seconds while serving, and records what the servicer asked."""

    wait: float = 0.4
    asked: list = field(default_factory=list)

    def pause(self, cpu_s, elapsed_s, since_call_s):
        self.asked.append((cpu_s, elapsed_s, since_call_s))
        return self.wait if since_call_s <= self.idle_s else 0.0


def test_the_servicer_pauses_between_layers_only_while_serving(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc") as (srv,):
        pacer = srv.servicer.pacer = Recording(cpus=1.0)
        two_layers = expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=l, expert_ids=[0, 1]) for l in (0, 1)])
        held = call(loop, srv.port, "LoadExperts", two_layers)  # no call served yet: no pauses
        assert [list(le.expert_ids) for le in held.experts] == [[0, 1], [0, 1]] and held.change_seconds > 0
        assert len(pacer.asked) == 2 and all(since == math.inf and cpu >= 0 for cpu, _, since in pacer.asked)
        stream(loop, srv.port, [request_message(routed_request(3, [0, 1], layer=0))])
        start = time.monotonic()
        more = expert_pb2.LoadExpertsRequest(experts=[expert_pb2.LayerExperts(layer=l, expert_ids=[2]) for l in (0, 1)])
        held = call(loop, srv.port, "LoadExperts", more)
        wall = time.monotonic() - start
        assert [list(le.expert_ids) for le in held.experts] == [[0, 1, 2], [0, 1, 2]]
        assert len(pacer.asked) == 4 and all(since < 1.0 for _, _, since in pacer.asked[2:])
        assert wall >= 2 * pacer.wait and held.change_seconds < wall - 1.5 * pacer.wait  # the pauses are not loading time
        dropped = call(loop, srv.port, "DropExperts", expert_pb2.DropExpertsRequest(experts=[expert_pb2.LayerExperts(layer=0, expert_ids=[2])]))
        assert list(dropped.experts[0].expert_ids) == [0, 1] and len(pacer.asked) == 5
