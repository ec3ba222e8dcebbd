"""The step loop with a scripted engine: a failure ends only the sequences it concerns, with a
status naming its cause, and the loop keeps going."""
import asyncio
import threading
from collections import deque

import pytest

import grpc

from attention_svc.step_loop import MAX_LOOP_ERRORS, StepLoop
from moemesh.engine import SamplingParams, StepFailed, StepOutput
from moemesh.errors import MeshError


def ExpertDown(message: str) -> MeshError:
    """What the expert path raises when a server fails: a MeshError naming it."""
    return MeshError(grpc.StatusCode.UNAVAILABLE, message, server_id="expert-1", address="127.0.0.1:1")


class ScriptedEngine:
    """Each request emits `n` tokens, one per step, `max_seqs` at a time (the rest wait).
    `fail_next = exc` makes the next step fail for the running ones (as `LLMEngine` does: they are
    removed and `StepFailed` names them); `errors[rid] = exc` makes rid fail alone at its next
    token (rid: the client's id; the engine sees the loop's keys `rid#n`); `gate` (a threading.Event)
    holds the next step until set, `hold(k)` holds the k-th step."""

    def __init__(self, n=3, max_seqs=64):
        self.n = n
        self.max_seqs = max_seqs
        self.running: dict[str, int] = {}
        self.queued: deque[str] = deque()
        self.pending: list[StepOutput] = []
        self.fail_next: Exception | None = None
        self.errors: dict[str, Exception] = {}
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()
        self.steps = 0
        self._holds: dict[int, tuple[threading.Event, threading.Event]] = {}
        self.scheduler = type("S", (), {"waiting": self.queued, "running": []})()

    def add_request(self, rid, ids, params):
        if not ids:
            raise ValueError("prompt_token_ids: must hold at least one token")
        if rid in self.running or rid in self.queued:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.queued.append(rid)

    def abort(self, rid):
        if self.running.pop(rid, None) is None:
            if rid not in self.queued:
                return False
            self.queued.remove(rid)
        self.pending.append(StepOutput(rid, None, None, True, "abort"))
        return True

    def has_unfinished(self):
        return bool(self.running or self.queued or self.pending)

    def hold(self, k):
        """(entered, release): step k sets `entered`, then waits for `release`."""
        self._holds[k] = (threading.Event(), threading.Event())
        return self._holds[k]

    def step(self):
        self.steps += 1
        self.in_step.set()
        if self.steps in self._holds:
            entered, release = self._holds.pop(self.steps)
            entered.set()
            release.wait(10)
        if self.gate is not None:
            gate, self.gate = self.gate, None
            gate.wait(10)
        while self.queued and len(self.running) < self.max_seqs:
            self.running[self.queued.popleft()] = 0
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            batch = tuple(self.running)
            self.running.clear()
            raise StepFailed(batch, exc)
        outs, self.pending = self.pending, []
        for rid in list(self.running):
            if rid.rsplit("#", 1)[0] in self.errors:
                del self.running[rid]
                outs.append(StepOutput(rid, None, None, True, "error", error=self.errors.pop(rid.rsplit("#", 1)[0])))
                continue
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
            return await asyncio.wait_for(body(loop), 20)
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


def test_a_failed_expert_call_fails_the_running_streams_unavailable_and_the_loop_keeps_serving():
    engine = ScriptedEngine(n=3)

    async def body(loop):
        engine.fail_next = ExpertDown("expert server gone")
        first = await drain(loop.add("a", [1], SamplingParams()))
        second = await drain(loop.add("b", [1], SamplingParams()))
        return first, second

    first, second = run_with_loop(engine, body)
    assert isinstance(first[-1], MeshError) and first[-1].code == grpc.StatusCode.UNAVAILABLE
    assert first[-1].message.startswith("experts: ") and "expert server gone" in first[-1].message
    assert second[-1].finish_reason == "length"


def test_any_other_failed_step_is_internal_naming_the_cause():
    engine = ScriptedEngine(n=3)

    async def body(loop):
        engine.fail_next = OverflowError("cannot convert float infinity to integer")
        return await drain(loop.add("a", [1], SamplingParams()))

    err = run_with_loop(engine, body)[-1]
    assert err.code == grpc.StatusCode.INTERNAL
    assert err.message.startswith("engine: ") and "OverflowError: cannot convert float infinity" in err.message


def test_a_failed_step_with_a_rejected_request_queued_keeps_the_loop_serving():
    """The wedge of issue 16: a step fails while a request the engine will reject is queued."""
    engine = ScriptedEngine(n=3)

    async def body(loop):
        gate = engine.gate = threading.Event()
        a = loop.add("a", [1], SamplingParams())
        await asyncio.to_thread(engine.in_step.wait, 10)
        rejected = loop.add("rejected", [], SamplingParams())  # queued while the step runs
        waiting = loop.add("waiting", [2], SamplingParams())
        engine.fail_next = ExpertDown("failover timed out")
        gate.set()
        results = await drain(a), await drain(rejected), await drain(waiting)
        return (*results, await drain(loop.add("later", [3], SamplingParams())))

    a, rejected, waiting, later = run_with_loop(engine, body)
    assert a[-1].code == grpc.StatusCode.UNAVAILABLE
    assert rejected[-1].code == grpc.StatusCode.INVALID_ARGUMENT and rejected[-1].message.startswith("prompt_token_ids: ")
    assert [o.token_id for o in waiting] == [101, 102, 103]  # not in the failed step: untouched
    assert later[-1].finish_reason == "length"


def test_a_failed_step_fails_only_its_batch():
    engine = ScriptedEngine(n=3, max_seqs=1)

    async def body(loop):
        gate = engine.gate = threading.Event()
        a = loop.add("a", [1], SamplingParams())
        b = loop.add("b", [1], SamplingParams())  # waits: one sequence at a time
        await asyncio.to_thread(engine.in_step.wait, 10)
        engine.fail_next = ExpertDown("gone")
        gate.set()
        return await drain(a), await drain(b)

    a, b = run_with_loop(engine, body)
    assert a[-1].code == grpc.StatusCode.UNAVAILABLE
    assert [o.token_id for o in b] == [101, 102, 103]


@pytest.mark.parametrize("error, code, message", [
    (ValueError("temperature: must be finite"), grpc.StatusCode.INVALID_ARGUMENT, "temperature: must be finite"),
    (RuntimeError("logits: the model computed NaN"), grpc.StatusCode.INTERNAL, "logits: the model computed NaN"),
])
def test_a_sequence_that_fails_alone_ends_with_its_status_and_its_mates_go_on(error, code, message):
    engine = ScriptedEngine(n=3)

    async def body(loop):
        bad = loop.add("bad", [1], SamplingParams())
        mate = loop.add("mate", [1], SamplingParams())
        engine.errors["bad"] = error
        return await drain(bad), await drain(mate)

    bad, mate = run_with_loop(engine, body)
    assert isinstance(bad[-1], MeshError) and (bad[-1].code, bad[-1].message) == (code, message)
    assert [o.token_id for o in mate] == [101, 102, 103]


def test_a_request_id_is_free_as_soon_as_it_is_aborted():
    engine = ScriptedEngine(n=5)

    async def body(loop):
        entered, release = engine.hold(2)  # the abort cannot reach the engine while step 2 runs
        first = loop.add("x", [1], SamplingParams())
        assert (await first.get()).token_id == 101
        await asyncio.to_thread(entered.wait, 10)
        assert loop.abort("x")
        ended = first.get_nowait()
        again = loop.add("x", [1], SamplingParams())  # no ALREADY_EXISTS
        release.set()
        return ended, await drain(again)

    ended, again = run_with_loop(engine, body)
    assert ended.finished and ended.finish_reason == "abort"
    assert [o.token_id for o in again] == [101, 102, 103, 104, 105]
    assert all(o.request_id == "x" for o in again)


def test_an_error_between_steps_fails_the_engines_sequences_and_the_loop_goes_on():
    engine = ScriptedEngine(n=3)
    boom = {"armed": False}

    def between():
        if boom["armed"]:
            boom["armed"] = False
            raise RuntimeError("placement adoption failed")

    async def body(loop):
        a = loop.add("a", [1], SamplingParams())
        assert (await a.get()).token_id == 101
        boom["armed"] = True
        first = await drain(a)
        return first, await drain(loop.add("b", [1], SamplingParams()))

    first, second = run_with_loop(engine, body, between=between)
    assert first[-1].code == grpc.StatusCode.INTERNAL and "placement adoption failed" in first[-1].message
    assert second[-1].finish_reason == "length"


def test_the_loop_ends_after_repeated_errors_outside_the_engine():
    def between():
        raise RuntimeError("broken for good")

    async def main():
        loop = StepLoop(ScriptedEngine(), between_steps=between)
        with pytest.raises(RuntimeError, match="broken for good"):
            await asyncio.wait_for(loop.run(), 20)
        loop.close()
        return MAX_LOOP_ERRORS

    assert asyncio.run(main()) >= 2


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
