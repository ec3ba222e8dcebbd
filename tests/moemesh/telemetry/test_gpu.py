import sys

import pytest

from moemesh.telemetry import GpuTelemetry
from tests.moemesh.telemetry.fake_nvml import FakeNvml


def test_reads_a_fake_gpu():
    nvml = FakeNvml()
    gpu = GpuTelemetry(0, nvml)
    s = gpu.read()
    assert s.available and s.name == "NVIDIA H200"
    assert s.utilization == pytest.approx(0.87)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (40 * 2**30, 141 * 2**30)
    assert s.power_watts == pytest.approx(523.0)
    gpu.read()
    gpu.close()
    assert (nvml.inits, nvml.shutdowns) == (1, 1)
    assert not gpu.read().available


@pytest.mark.parametrize("nvml, index", [(FakeNvml(fail_init=True), 0), (FakeNvml(), 3), (FakeNvml(fail_query=True), 0)])
def test_failures_report_unavailable(nvml, index):
    gpu = GpuTelemetry(index, nvml)
    s = gpu.read()
    assert not s.available and s.memory_total_bytes == 0


def test_pynvml_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now raises ImportError
    gpu = GpuTelemetry(0)
    assert not gpu.available and not gpu.read().available
    gpu.close()


def test_real_pynvml_on_this_machine_never_raises():
    s = GpuTelemetry(0).read()  # no NVML driver here: unavailable; on a GPU box: a real sample
    assert s.available == (s.memory_total_bytes > 0)


def test_for_device():
    assert GpuTelemetry.for_device("cuda:2", env={}).device_index == 2
    assert GpuTelemetry.for_device("cuda", env={}).device_index == 0
    cpu = GpuTelemetry.for_device("cpu", FakeNvml())
    assert cpu.device_index is None and not cpu.read().available
    with pytest.raises(ValueError, match="device_index"):
        GpuTelemetry(-1)


def test_for_device_maps_cuda_visible_devices():
    # CUDA ordinal 1 under CUDA_VISIBLE_DEVICES=3,0 is NVML device 0
    assert GpuTelemetry.for_device("cuda:1", env={"CUDA_VISIBLE_DEVICES": "3,0"}).device_index == 0
    assert GpuTelemetry.for_device("cuda:1", FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "3,0"}).read().available
    assert not GpuTelemetry.for_device("cuda:0", FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "3,0"}).read().available
    by_uuid = GpuTelemetry.for_device("cuda:0", FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "GPU-0a1b"})
    assert by_uuid.uuid == "GPU-0a1b" and by_uuid.read().name == "NVIDIA H200"
    hidden = GpuTelemetry.for_device("cuda:2", FakeNvml(), env={"CUDA_VISIBLE_DEVICES": "0"})
    assert hidden.device_index is None and not hidden.read().available
    assert not GpuTelemetry.for_device("cuda:0", FakeNvml(), env={"CUDA_VISIBLE_DEVICES": ""}).read().available
