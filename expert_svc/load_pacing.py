"""`LoadPacer`: while an expert server serves, its placement changes take at most a share of its CPU.

A layer change (LoadExperts or DropExperts of one layer's experts) copies the layer's weights into
one new tensor: tens of milliseconds of CPU for a mid-sized layer. On a server under a CPU budget
(its cgroup's quota) that CPU comes out of the budget its calls run on, and a quota spent on copies
stalls the next call until the next quota period; the server holding the hot experts, the one a
rebalance relieves, has no spare budget at all. So after each layer change, while the server has
served a call within the last `idle_s`, the servicer pauses until the change's CPU is at most `share`
of the server's CPUs over the time since it began. An idle server (the first placement at start)
changes layers at full speed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadPacer:
    cpus: float  # CPUs the server may use (its budget, else its cores)
    share: float = 0.1  # of them, what placement changes may use while serving (1: no pauses)
    idle_s: float = 1.0  # a server without a call for this long is not serving

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"load_cpu_share must be in (0, 1], got {self.share!r}")
        if not self.cpus > 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus!r}")

    def pause(self, cpu_s: float, elapsed_s: float, since_call_s: float) -> float:
        """Seconds to wait after a layer change that took `cpu_s` of CPU over `elapsed_s`, the last
        call `since_call_s` ago."""
        if self.share >= 1.0 or since_call_s > self.idle_s:
            return 0.0
        return max(0.0, cpu_s / (self.share * self.cpus) - elapsed_s)


def cpu_timed(fn):
    """fn(*args) -> (its result, the calling thread's CPU seconds it took)."""
    def run(*args):
        start = time.thread_time()
        out = fn(*args)
        return out, time.thread_time() - start

    run.__name__ = getattr(fn, "__name__", "call")
    return run
