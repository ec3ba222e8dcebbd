"""`GpuTelemetry`: one GPU's utilization, memory and power through NVML (`pynvml`), never crashing.

Where NVML is missing (no driver, CPU-only machine, `--device cpu`) or a query fails, `read()`
returns a `GpuSample` with `available=False` and zeros; the service keeps running.
"""
from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class GpuSample:
    available: bool
    name: str = ""
    utilization: float = 0.0  # fraction of the last sample period the GPU was busy, 0..1
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    power_watts: float = 0.0


UNAVAILABLE = GpuSample(available=False)


def _load_nvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except Exception:  # ImportError, or a broken install raising anything at import
        return None


class GpuTelemetry:
    """Reads one GPU through `nvml` (default: `import pynvml`; tests inject a fake module):
    NVML device `device_index` (None = no GPU), or the GPU with NVML UUID `uuid`. NVML is
    initialised on the first `read()` and shut down by `close()`; a failed init is not retried.
    Services start from their torch device with `for_device`."""

    def __init__(self, device_index: int | None = 0, nvml: ModuleType | None = None, uuid: str | None = None) -> None:
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0):
            raise ValueError(f"device_index must be an int >= 0 or None, got {device_index!r}")
        self.device_index = device_index
        self.uuid = uuid
        self._nvml = nvml
        self._lock = threading.Lock()
        self._handle = None
        self._state = "new"  # new | ready | failed | closed

    @classmethod
    def for_device(cls, device: str, nvml: ModuleType | None = None, env: Mapping[str, str] | None = None) -> "GpuTelemetry":
        """From a torch device string: "cuda" / "cuda:N" read CUDA device N, anything else nothing.

        NVML ignores `CUDA_VISIBLE_DEVICES`, so the CUDA ordinal is mapped through it (from `env`,
        default os.environ): entry N is an NVML index or a `GPU-`/`MIG-` UUID. Without it, CUDA
        ordinal N is NVML index N (true with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, and inside a
        container that sees one GPU)."""
        env = os.environ if env is None else env
        if device == "cuda":
            ordinal = 0
        elif device.startswith("cuda:") and device[5:].isdigit():
            ordinal = int(device[5:])
        else:
            return cls(None, nvml)
        visible = [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if "CUDA_VISIBLE_DEVICES" not in env:
            return cls(ordinal, nvml)
        if ordinal >= len(visible):
            return cls(None, nvml)  # CUDA itself cannot see this device
        entry = visible[ordinal]
        if entry.isdigit():
            return cls(int(entry), nvml)
        return cls(0, nvml, uuid=entry)

    def _init(self) -> bool:
        if self._state == "ready":
            return True
        if self._state != "new" or self.device_index is None:
            return False
        nvml = self._nvml or _load_nvml()
        try:
            if nvml is None:
                raise RuntimeError("pynvml is not installed")
            nvml.nvmlInit()
            if self.uuid is not None:
                self._handle = nvml.nvmlDeviceGetHandleByUUID(self.uuid)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self._nvml = nvml
            self._state = "ready"
            return True
        except Exception:
            self._state = "failed"
            return False

    @property
    def available(self) -> bool:
        with self._lock:
            return self._init()

    def read(self) -> GpuSample:
        with self._lock:
            if not self._init():
                return UNAVAILABLE
            nvml, h = self._nvml, self._handle
            try:
                name = nvml.nvmlDeviceGetName(h)
                util = nvml.nvmlDeviceGetUtilizationRates(h)
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                power_mw = nvml.nvmlDeviceGetPowerUsage(h)
            except Exception:
                return UNAVAILABLE
            return GpuSample(
                available=True,
                name=name.decode() if isinstance(name, bytes) else str(name),
                utilization=float(util.gpu) / 100.0,
                memory_used_bytes=int(mem.used),
                memory_total_bytes=int(mem.total),
                power_watts=float(power_mw) / 1000.0,
            )

    def close(self) -> None:
        with self._lock:
            if self._state == "ready":
                try:
                    self._nvml.nvmlShutdown()
                except Exception:
                    pass
            self._state = "closed"
