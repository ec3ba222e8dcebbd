"""A stand-in for the `pynvml` module: answers for GPU 0 (UUID GPU-0a1b) only, counts init/shutdown calls."""
from __future__ import annotations

from types import SimpleNamespace


class FakeNvml:
    def __init__(self, fail_init: bool = False, fail_query: bool = False) -> None:
        self.fail_init, self.fail_query = fail_init, fail_query
        self.inits = self.shutdowns = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int):
        if index != 0:
            raise RuntimeError("Invalid Argument")
        return "gpu0"

    def nvmlDeviceGetHandleByUUID(self, uuid: str):
        if uuid != "GPU-0a1b":
            raise RuntimeError("Not Found")
        return "gpu0"

    def nvmlDeviceGetName(self, handle) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.fail_query:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=40 * 2**30, total=141 * 2**30, free=101 * 2**30)

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        return 523_000  # milliwatts
