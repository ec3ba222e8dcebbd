"""An `LLMEngine` in a spawned process of its own, driven over a pipe.

Its load time and peak RSS are the engine's alone (not the benchmark's, which may hold a
transformers or llama.cpp model, nor a previous engine's), and its decode rates, CPU time included,
are measured inside it. The parent sends a request and waits for the answer; an exception in the
engine process comes back with its traceback, a process that dies (out of memory) is reported with
its exit code.
"""
from __future__ import annotations

import multiprocessing as mp
import resource
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bench.timing import Rate, engine_decode_rate


@dataclass(frozen=True)
class LoadReport:
    """load_s: wall seconds of `LLMEngine(config)`; rss_before: resident bytes just before it (Python,
    torch and moemesh imported)."""

    load_s: float
    rss_before: int


@dataclass(frozen=True)
class Memory:
    """peak_rss: the process's high-water resident bytes so far; rss_anon / rss_file: resident now,
    anonymous (copies the engine made) and file-backed (memory-mapped checkpoint pages)."""

    peak_rss: int
    rss_anon: int
    rss_file: int


def memory() -> Memory:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    status = Path("/proc/self/status")
    fields = {}
    if status.is_file():
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return Memory(fields.get("VmHWM", peak), fields.get("RssAnon", 0), fields.get("RssFile", 0))


def _serve(conn, config) -> None:
    """The engine process: load, report, then answer requests until told to close."""
    try:
        from moemesh.engine import LLMEngine

        before = memory()
        start = time.perf_counter()
        engine = LLMEngine(config)
        conn.send(("ok", LoadReport(time.perf_counter() - start, before.rss_anon + before.rss_file)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        request = conn.recv()
        try:
            if request[0] == "decode":
                conn.send(("ok", engine_decode_rate(engine, request[1], request[2])))
            elif request[0] == "memory":
                conn.send(("ok", memory()))
            else:  # "close"
                conn.send(("ok", None))
                return
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class EngineProcess:
    """`with EngineProcess(EngineConfig(...)) as engine:` then `engine.load`, `engine.decode(...)`,
    `engine.memory()`."""

    def __init__(self, config, load_timeout_s: float = 1800.0) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: nothing inherited from the benchmark
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, config), daemon=True)
        self._proc.start()
        child.close()
        try:
            self.load: LoadReport = self._answer(load_timeout_s)
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout_s: float | None = None):
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} (out of memory?)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine process did not answer within {timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} (out of memory?)") from None
        if status == "error":
            raise RuntimeError(f"the engine process failed:\n{value}")
        return value

    def decode(self, batch: Sequence[Sequence[int]], new_tokens: int) -> Rate:
        self._conn.send(("decode", [list(p) for p in batch], new_tokens))
        return self._answer()

    def memory(self) -> Memory:
        self._conn.send(("memory",))
        return self._answer()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
                self._answer(30)
            except (OSError, RuntimeError, TimeoutError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
