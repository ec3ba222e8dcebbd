"""The step loop with a scripted engine: failures end the affected streams, the loop keeps going."""
import asyncio
from collections import deque

import pytest

import grpc

from attention_svc.step_loop import StepLoop
from moemesh.engine import SamplingParams, StepOutput
from moemesh.errors import MeshError


class ScriptedEngine:
    """Each request emits `n` tokens, one per step; `fail_next` makes the next step raise."""

    def __init__(self, n=3):
        self.n = n
        self.running: dict[str, int] = {}
        self.pending: list[StepOutput] = []
        self.fail_next = False
        self.scheduler = type("S", (), {"waiting": deque(), "running": []})()

    def add_request(self, rid, ids, params):
        if not ids:
            raise ValueError("prompt_token_ids must hold at least one token")
        self.running[rid] = 0

    def abort(self, rid):
        if self.running.pop(rid, None) is None:
            return False
        self.pending.append(StepOutput(rid, None, None, True, "abort"))
        return True

    def has_unfinished(self):
        return bool(self.running or self.pending)

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("expert server gone")
        outs, self.pending = self.pending, []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.n
            outs.append(StepOutput(rid, 100 + self.running[rid], -1.0, done, "length" if done else None))
            if done:
                del self.running[rid]
        return outs


async def drain(queue):
    items = []
    while True:
        item = await queue.get()
        items.append(item)
        if isinstance(item, Exception) or item.finished:
            return items


def run_with_loop(engine, body, between=lambda: None):
    async def main():
        loop = StepLoop(engine, between_steps=between)
        task = asyncio.create_task(loop.run())
        try:
            return await body(loop)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            loop.close()

    return asyncio.run(main())


def test_outputs_reach_their_streams():
    async def body(loop):
        a = loop.add("a", [1], SamplingParams())
        b = loop.add("b", [2], SamplingParams())
        return await drain(a), await drain(b)

    a, b = run_with_loop(ScriptedEngine(n=3), body)
    assert [o.token_id for o in a] == [101, 102, 103] and a[-1].finish_reason == "length"
    assert [o.token_id for o in b] == [101, 102, 103]


def test_a_rejected_add_fails_only_that_stream():
    async def body(loop):
        bad = loop.add("bad", [], SamplingParams())
        good = loop.add("good", [1], SamplingParams())
        return await drain(bad), await drain(good)

    bad, good = run_with_loop(ScriptedEngine(), body)
    assert isinstance(bad[0], MeshError) and bad[0].code == grpc.StatusCode.INVALID_ARGUMENT
    assert good[-1].finish_reason == "length"


def test_a_failed_step_fails_the_running_streams_and_the_loop_keeps_serving():
    engine = ScriptedEngine(n=3)

    async def body(loop):
        engine.fail_next = True
        first = await drain(loop.add("a", [1], SamplingParams()))
        second = await drain(loop.add("b", [1], SamplingParams()))
        return first, second

    first, second = run_with_loop(engine, body)
    assert isinstance(first[-1], MeshError) and first[-1].code == grpc.StatusCode.UNAVAILABLE
    assert "expert server gone" in first[-1].message
    assert second[-1].finish_reason == "length"


def test_duplicate_ids_are_refused_and_between_steps_runs():
    calls = []

    async def body(loop):
        q = loop.add("a", [1], SamplingParams())
        with pytest.raises(MeshError) as e:
            loop.add("a", [1], SamplingParams())
        await drain(q)
        return e.value

    err = run_with_loop(ScriptedEngine(), body, between=lambda: calls.append(1))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS
    assert len(calls) >= 3
