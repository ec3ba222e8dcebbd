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


def test_work_over_the_window_counts_calls_experts_rows_and_service_time():
    clock, cpu = Clock(), Clock()
    stats = ShardStats([0, 1], 8, window_s=10.0, clock=clock, cpu_limit=0.5, cpu_clock=cpu)
    stats.enter()
    clock.t = 0.25
    stats.record(0, torch.tensor([3, 5, 6]), torch.tensor([4, 0, 2]), 0.125, compute_cpu=0.0625, call_cpu=0.001)  # expert 5 got no rows: not computed
    stats.leave(call_cpu=0.002)  # decoding and encoding: the call's CPU outside the forward
    stats.enter()
    stats.enter()  # two calls overlap: service time counts the time with any in service, once
    clock.t = 1.0
    stats.record(1, torch.tensor([3]), torch.tensor([2]), 0.5)
    stats.leave()
    clock.t = 1.5
    stats.record(1, torch.tensor([2]), torch.tensor([1]), 0.25)
    stats.leave()
    stats.changed(0.125)  # a LoadExperts layer's CPU: counted apart from the calls'
    cpu.t = 0.75  # the process's CPU time: what the window adds by the snapshot
    snap = stats.snapshot()
    assert snap.work == {"requests": 3, "expert_calls": 4, "rows": 9, "busy_seconds": 0.875, "service_seconds": 1.5,
                         "cpu_seconds": 0.75, "compute_cpu_seconds": 0.0625, "call_cpu_seconds": 0.003, "change_cpu_seconds": 0.125,
                         "seconds": 1.5}
    assert snap.cpu_limit == 0.5


def test_stats_and_metrics_endpoint_without_a_gpu(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, preload="all", transport="grpc", metrics_port=0) as (srv,):
        req = routed_request(9, [1, 6], layer=1, top_k=1)
        (answer,) = stream(loop, srv.port, [request_message(req)])
        assert not answer.error_code
        stats = call(loop, srv.port, "GetStats", expert_pb2.GetStatsRequest())
        assert {(l.layer, l.expert_id): l.tokens for l in stats.loads} == {(1, e): n for e, n in zip([1, 6], req.counts.tolist()) if n}
        assert stats.gpu.available is False and stats.gpu.memory_total_bytes == 0  # no NVML here: reported, no crash
        assert stats.queue_depth == 0 and stats.busy_seconds > 0
        work = stats.window_work
        assert (work.requests, work.expert_calls, work.rows) == (1, sum(1 for n in req.counts.tolist() if n), int(req.counts.sum()))
        assert 0 < work.busy_seconds <= work.service_seconds <= work.seconds
        # the call's thread CPU, inside the kernel and outside it, both measured and part of the process's
        assert work.compute_cpu_seconds > 0 and work.call_cpu_seconds > 0
        assert work.compute_cpu_seconds + work.call_cpu_seconds <= work.cpu_seconds
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_server.port}/metrics", timeout=10).read().decode()
        assert 'moemesh_expert_tokens_total{expert="6",layer="1",service="expert"}' in body or \
            'moemesh_expert_tokens_total{service="expert",layer="1",expert="6"}' in body
        assert 'moemesh_gpu_available{service="expert"} 0.0' in body
        assert 'moemesh_queue_depth{service="expert"} 0.0' in body
        assert "moemesh_busy_seconds_total" in body
