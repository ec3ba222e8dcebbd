"""Telemetry every service exports: expert load, GPU state, Prometheus metrics.

API for the services (construct one of each per service instance; no globals):

- `ExpertLoadCounter(layers, num_experts, window_s=60, buckets=12)`:
  `add(layer, counts[E])` or `add_sparse(layer, expert_ids[G], counts[G])` from the hot path
  (CPU int64 counts), `add_all(counts[L,E])`,
  `window() -> [L,E]` tokens in the last `window_s` s (load reports to the control plane, solver
  input), `totals() -> [L,E]` since start.
- `SlidingSums(names, window_s=60, buckets=12)`: `add(name=value, ...)`, `window() -> {name: sum,
  "seconds": covered}` (an expert server's calls, rows and busy time over its load window).
- `GpuTelemetry(device_index)` or `GpuTelemetry.for_device("cuda:0" | "cpu")` (maps the CUDA
  ordinal through `CUDA_VISIBLE_DEVICES` to the NVML device, index or UUID):
  `read() -> GpuSample(available, name, utilization, memory_used_bytes, memory_total_bytes,
  power_watts)`; `available=False` (never an exception) without NVML; `close()`.
- `ServiceMetrics(service, load=counter, gpu=gpu)`: a per-instance `CollectorRegistry`
  (`.registry`) with the mesh's metrics (table in `metrics.py`); `set_queue_depth(n)`,
  `add_busy(s)` or `with busy():`, `observe_step(seconds, batch_size)`,
  `set_placement(version, balancedness)`, `render() -> bytes`,
  `serve(port=0, host="0.0.0.0") -> MetricsServer` (`.port` bound, `.stop()`).
"""
from moemesh.telemetry.exporter import MetricsServer
from moemesh.telemetry.gpu import GpuSample, GpuTelemetry
from moemesh.telemetry.load_counter import ExpertLoadCounter
from moemesh.telemetry.metrics import ServiceMetrics
from moemesh.telemetry.sliding_sums import SlidingSums

__all__ = ["ExpertLoadCounter", "GpuSample", "GpuTelemetry", "MetricsServer", "ServiceMetrics", "SlidingSums"]
