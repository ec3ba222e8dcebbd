"""`ServiceMetrics`: the mesh's Prometheus metrics for one service instance, in its own registry.

Metric names (every one labelled `service`, the service kind: router|attention|expert|control|gateway):

| name | type | labels | set by |
| --- | --- | --- | --- |
| `moemesh_expert_tokens_total` | counter | layer, expert | read from the `ExpertLoadCounter` at scrape |
| `moemesh_queue_depth` | gauge | | `set_queue_depth` |
| `moemesh_busy_seconds_total` | counter | | `add_busy` / `with busy():` |
| `moemesh_step_seconds` | histogram | | `observe_step` |
| `moemesh_batch_size` | histogram | | `observe_step` |
| `moemesh_gpu_available` | gauge | | read from the `GpuTelemetry` at scrape |
| `moemesh_gpu_utilization_ratio` | gauge | | idem, 0..1 |
| `moemesh_gpu_memory_used_bytes`, `moemesh_gpu_memory_total_bytes` | gauge | | idem |
| `moemesh_gpu_power_watts` | gauge | | idem |
| `moemesh_placement_balancedness` | gauge | | `set_placement` (control plane) |
| `moemesh_placement_version` | gauge | | `set_placement` |
| `moemesh_http_requests_total` | counter | endpoint, status | `observe_request` (gateway) |
| `moemesh_time_to_first_token_seconds` | histogram | endpoint | `observe_ttft` (gateway) |
| `moemesh_tokens_total` | counter | kind (prompt, completion) | `add_tokens` (gateway) |
| `moemesh_prefix_cache_queries_total` | counter | | read from the engine's `SchedulerStats` at scrape (attention): prompt tokens looked up |
| `moemesh_prefix_cache_hits_total` | counter | | idem: prompt tokens found in the prefix cache (not computed again) |
| `moemesh_prefix_cache_hit_ratio` | gauge | | idem: hits / queries since start (0 before any lookup) |
| `moemesh_preemptions_total` | counter | | idem: sequences preempted (recomputed later) for want of KV blocks |

The autoscalers (`deploy/k8s`) read, through the Prometheus adapter, `moemesh_queue_depth` and
the rate of `moemesh_busy_seconds_total` (busy seconds per second: the busy fraction) of expert
servers, and the mean `moemesh_batch_size` of attention replicas. The prefix cache's hit rate over
a window is `rate(moemesh_prefix_cache_hits_total) / rate(moemesh_prefix_cache_queries_total)`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from moemesh.telemetry.exporter import MetricsServer
from moemesh.telemetry.gpu import GpuTelemetry
from moemesh.telemetry.load_counter import ExpertLoadCounter

if TYPE_CHECKING:
    from moemesh.engine.scheduler import SchedulerStats

SERVICES = ("router", "attention", "expert", "control", "gateway")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _ScrapeCollector:
    """Reads the load counter, the GPU and the scheduler's counters when Prometheus scrapes, so the hot
    path never touches them."""

    def __init__(self, service: str, load: ExpertLoadCounter | None, gpu: GpuTelemetry | None,
                 scheduler: SchedulerStats | None = None) -> None:
        self.service, self.load, self.gpu, self.scheduler = service, load, gpu, scheduler

    def collect(self):
        if self.load is not None:
            fam = CounterMetricFamily(
                "moemesh_expert_tokens", "Tokens routed to each (layer, expert)", labels=["service", "layer", "expert"]
            )
            totals = self.load.totals().tolist()
            for layer, row in zip(self.load.layer_ids, totals):
                for e, n in enumerate(row):
                    fam.add_metric([self.service, str(layer), str(e)], n)
            yield fam
        if self.scheduler is not None:
            st = self.scheduler
            for name, doc, value in (
                ("moemesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", st.prefix_queries),
                ("moemesh_prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again)", st.prefix_hits),
                ("moemesh_preemptions", "Sequences preempted for want of KV blocks (recomputed later)", st.preemptions),
            ):
                c = CounterMetricFamily(name, doc, labels=["service"])
                c.add_metric([self.service], value)
                yield c
            g = GaugeMetricFamily("moemesh_prefix_cache_hit_ratio", "Prefix cache hits / queries since start", labels=["service"])
            g.add_metric([self.service], st.prefix_hit_rate)
            yield g
        if self.gpu is not None:
            s = self.gpu.read()
            for name, doc, value in (
                ("moemesh_gpu_available", "1 when NVML answers for this service's GPU", 1.0 if s.available else 0.0),
                ("moemesh_gpu_utilization_ratio", "GPU busy fraction over NVML's last sample period", s.utilization),
                ("moemesh_gpu_memory_used_bytes", "GPU memory in use", float(s.memory_used_bytes)),
                ("moemesh_gpu_memory_total_bytes", "GPU memory in total", float(s.memory_total_bytes)),
                ("moemesh_gpu_power_watts", "GPU power draw", s.power_watts),
            ):
                g = GaugeMetricFamily(name, doc, labels=["service"])
                g.add_metric([self.service], value)
                yield g


class ServiceMetrics:
    """The metrics of one service instance. All methods are thread-safe and cheap.

        m = ServiceMetrics("expert", load=counter, gpu=GpuTelemetry.for_device("cuda:0"))
        m = ServiceMetrics("attention", scheduler=engine.stats)   # prefix cache and preemption counters
        server = m.serve(port)           # /metrics on `port` (0 = ephemeral); server.port, server.stop()
        m.set_queue_depth(3)
        with m.busy():                    # counts the block's wall time as busy
            ...
        m.observe_step(seconds=0.012, batch_size=48)
    """

    def __init__(self, service: str, *, load: ExpertLoadCounter | None = None, gpu: GpuTelemetry | None = None,
                 scheduler: SchedulerStats | None = None) -> None:
        if service not in SERVICES:
            raise ValueError(f"service must be one of {SERVICES}, got {service!r}")
        self.service = service
        self.load = load
        self.gpu = gpu
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["service"]
        self._queue = Gauge("moemesh_queue_depth", "Requests or expert batches waiting", lab, registry=r).labels(service)
        self._busy = Counter("moemesh_busy_seconds", "Seconds spent computing", lab, registry=r).labels(service)
        self._step = Histogram("moemesh_step_seconds", "Duration of one step", lab, buckets=STEP_BUCKETS, registry=r).labels(service)
        self._batch = Histogram("moemesh_batch_size", "Tokens per step", lab, buckets=BATCH_BUCKETS, registry=r).labels(service)
        self._balance = Gauge("moemesh_placement_balancedness", "Mean/max per-server expert load", lab, registry=r).labels(service)
        self._version = Gauge("moemesh_placement_version", "Placement version in force", lab, registry=r).labels(service)
        self._requests = Counter("moemesh_http_requests", "HTTP requests answered", ["service", "endpoint", "status"], registry=r)
        self._ttft = Histogram("moemesh_time_to_first_token_seconds", "Request start to first generated token",
                               ["service", "endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self._tokens = Counter("moemesh_tokens", "Prompt and generated tokens", ["service", "kind"], registry=r)
        r.register(_ScrapeCollector(service, load, gpu, scheduler))

    def set_queue_depth(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"queue depth must be >= 0, got {n}")
        self._queue.set(n)

    def add_busy(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"busy seconds must be >= 0, got {seconds}")
        self._busy.inc(seconds)

    @contextmanager
    def busy(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._busy.inc(time.perf_counter() - t0)

    def observe_step(self, seconds: float, batch_size: int) -> None:
        if seconds < 0 or batch_size < 0:
            raise ValueError(f"step seconds and batch_size must be >= 0, got {seconds}, {batch_size}")
        self._step.observe(seconds)
        self._batch.observe(batch_size)

    def set_placement(self, version: int, balancedness: float) -> None:
        if version < 0 or not 0.0 <= balancedness <= 1.0:
            raise ValueError(f"version must be >= 0 and balancedness in [0, 1], got {version}, {balancedness}")
        self._version.set(version)
        self._balance.set(balancedness)

    def observe_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(self.service, endpoint, str(status)).inc()

    def observe_ttft(self, endpoint: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time to first token must be >= 0, got {seconds}")
        self._ttft.labels(self.service, endpoint).observe(seconds)

    def add_tokens(self, prompt: int, completion: int) -> None:
        if prompt < 0 or completion < 0:
            raise ValueError(f"token counts must be >= 0, got {prompt}, {completion}")
        self._tokens.labels(self.service, "prompt").inc(prompt)
        self._tokens.labels(self.service, "completion").inc(completion)

    def render(self) -> bytes:
        """The text exposition format, as `/metrics` serves it."""
        return generate_latest(self.registry)

    def serve(self, port: int = 0, host: str = "0.0.0.0") -> MetricsServer:
        """Start `/metrics` on `host:port` (0 = ephemeral) on a daemon thread; returns the running server."""
        return MetricsServer(self.registry, port, host)
