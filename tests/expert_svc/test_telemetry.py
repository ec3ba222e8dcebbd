"""An expert server's telemetry: sliding-window load, queue depth and busy time, GPU stats that
say "none" without NVML, and the Prometheus /metrics endpoint."""
import urllib.request

import torch

from expert_svc.stats import ShardStats
from moemesh.transport.grpc_transport import request_message
from tests.fixtures.expert_servers import routed_request, running_expert_servers
from tests.expert_svc.test_server import call, expert_pb2, stream


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_load_slides_out_of_the_window_while_requests_and_busy_time_reset_on_demand():
    clock = Clock()
    stats = ShardStats([0, 1], 8, window_s=10.0, clock=clock)
    stats.record(0, torch.tensor([3, 5]), torch.tensor([4, 0]), 0.5)
    clock.t = 6.0
    stats.record(1, torch.tensor([3]), torch.tensor([2]), 0.25)
    snap = stats.snapshot(reset=True)
    assert snap.tokens == {(0, 3): 4, (1, 3): 2} and snap.requests == 2 and snap.busy_seconds == 0.75
    assert snap.window_seconds == 10.0
    clock.t = 12.0  # the first record left the window
    snap = stats.snapshot()
    assert snap.tokens == {(1, 3): 2} and snap.requests == 0 and snap.busy_seconds == 0.0


def test_stats_and_metrics_endpoint_without_a_gpu(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, preload="all", transport="grpc", metrics_port=0) as (srv,):
        req = routed_request(9, [1, 6], layer=1, top_k=1)
        (answer,) = stream(loop, srv.port, [request_message(req)])
        assert not answer.error_code
        stats = call(loop, srv.port, "GetStats", expert_pb2.GetStatsRequest())
        assert {(l.layer, l.expert_id): l.tokens for l in stats.loads} == {(1, e): n for e, n in zip([1, 6], req.counts.tolist()) if n}
        assert stats.gpu.available is False and stats.gpu.memory_total_bytes == 0  # no NVML here: reported, no crash
        assert stats.queue_depth == 0 and stats.busy_seconds > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_server.port}/metrics", timeout=10).read().decode()
        assert 'moemesh_expert_tokens_total{expert="6",layer="1",service="expert"}' in body or \
            'moemesh_expert_tokens_total{service="expert",layer="1",expert="6"}' in body
        assert 'moemesh_gpu_available{service="expert"} 0.0' in body
        assert 'moemesh_queue_depth{service="expert"} 0.0' in body
        assert "moemesh_busy_seconds_total" in body
