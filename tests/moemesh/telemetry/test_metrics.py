import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from moemesh.telemetry import ExpertLoadCounter, GpuTelemetry, ServiceMetrics
from tests.moemesh.telemetry.fake_nvml import FakeNvml


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_render_and_stay_per_instance():
    load = ExpertLoadCounter([1, 3], 2)
    m = ServiceMetrics("expert", load=load, gpu=GpuTelemetry(0, FakeNvml()))
    other = ServiceMetrics("expert")
    load.add(3, torch.tensor([5, 2]))
    m.set_queue_depth(4)
    m.add_busy(1.5)
    with m.busy():
        pass
    m.observe_step(0.02, 64)
    m.set_placement(7, 0.9)
    got = samples(m.render())
    svc = ("service", "expert")
    assert got[("moemesh_expert_tokens_total", (("expert", "0"), ("layer", "3"), svc))] == 5
    assert got[("moemesh_expert_tokens_total", (("expert", "1"), ("layer", "1"), svc))] == 0
    assert got[("moemesh_queue_depth", (svc,))] == 4
    assert got[("moemesh_busy_seconds_total", (svc,))] >= 1.5
    assert got[("moemesh_step_seconds_count", (svc,))] == 1
    assert got[("moemesh_batch_size_sum", (svc,))] == 64
    assert got[("moemesh_gpu_available", (svc,))] == 1
    assert got[("moemesh_gpu_power_watts", (svc,))] == pytest.approx(523.0)
    assert got[("moemesh_placement_version", (svc,))] == 7
    assert ("moemesh_queue_depth", (svc,)) in samples(other.render())
    assert samples(other.render())[("moemesh_queue_depth", (svc,))] == 0
    assert REGISTRY.get_sample_value("moemesh_queue_depth", {"service": "expert"}) is None


def test_scheduler_counters_are_read_at_scrape():
    from moemesh.engine.scheduler import SchedulerStats

    stats = SchedulerStats()
    m = ServiceMetrics("attention", scheduler=stats)
    svc = (("service", "attention"),)
    assert samples(m.render())[("moemesh_prefix_cache_hit_ratio", svc)] == 0
    stats.prefix_queries, stats.prefix_hits, stats.preemptions = 400, 300, 2
    got = samples(m.render())
    assert got[("moemesh_prefix_cache_queries_total", svc)] == 400
    assert got[("moemesh_prefix_cache_hits_total", svc)] == 300
    assert got[("moemesh_prefix_cache_hit_ratio", svc)] == 0.75
    assert got[("moemesh_preemptions_total", svc)] == 2


def test_no_gpu_reports_zero_available():
    got = samples(ServiceMetrics("attention", gpu=GpuTelemetry(None)).render())
    assert got[("moemesh_gpu_available", (("service", "attention"),))] == 0


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda m: m.set_queue_depth(-1), "queue depth"),
        (lambda m: m.add_busy(-0.1), "busy"),
        (lambda m: m.observe_step(0.1, -1), "batch_size"),
        (lambda m: m.set_placement(1, 1.5), "balancedness"),
    ],
)
def test_bad_values_name_field(call, field):
    with pytest.raises(ValueError, match=field):
        call(ServiceMetrics("router"))


def test_unknown_service_rejected():
    with pytest.raises(ValueError, match="service"):
        ServiceMetrics("frontend")


def test_http_endpoint_on_ephemeral_port():
    m = ServiceMetrics("control")
    m.set_placement(2, 0.75)
    server = m.serve(0, "127.0.0.1")
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert r.status == 200
            assert "text/plain" in r.headers["Content-Type"]
            assert samples(r.read())[("moemesh_placement_balancedness", (("service", "control"),))] == 0.75
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
        assert e.value.code == 404
    finally:
        server.stop()
    server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=2)
