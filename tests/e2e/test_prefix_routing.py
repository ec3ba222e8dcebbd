"""Two attention replicas (tiny Mixtral, experts in process, a 32-token step budget) behind one router,
as real processes: a prompt sharing a prefix with an earlier one lands on the same replica and
reports the cached tokens in its gRPC usage; distinct prompts still spread; a busy prefix holder
gives way; the replica's /metrics shows the prefix cache's hits; prompts longer than the budget give
what `moemesh run` gives."""
from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import grpc
import pytest

from moemesh.launcher.child import stop_all
from moemesh.rpc.generation import build_request
from tests.fixtures.services import assert_same_generation, attention_load, gen_grpc, generate_json, run_json, start_service

SYSTEM = [(7 * i) % 500 + 3 for i in range(64)]  # 4 blocks of 16


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    children, replicas = [], []
    try:
        for name in ("attention-a", "attention-b"):
            child, address = start_service("attention", logs, name=name, model_dir=tiny_model_dir, kv_cache_tokens=2048,
                                           max_num_batched_tokens=32, metrics_port=0)
            children.append(child)
            replicas.append(address)
        router, router_addr = start_service("router", logs, attention=",".join(replicas), prefix_imbalance=2, load_poll_s=0.05)
        children.append(router)
        yield {"router": router_addr, "replicas": replicas, "children": dict(zip(("a", "b"), children))}
    finally:
        stop_all(children, 10)


def accepted(mesh) -> list[int]:
    return [attention_load(a).accepted for a in mesh["replicas"]]


async def generate(router: str, prompts, max_new_tokens: int = 4) -> list:
    """The final response (usage, with all the stream's token ids) of each prompt, all sent at once."""
    async with grpc.aio.insecure_channel(router) as ch:
        stub = gen_grpc.GenerationStub(ch)

        async def one(p):
            req = build_request(prompt_token_ids=p, max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
            responses = [r async for r in stub.Generate(req, timeout=120)]
            final = responses[-1]
            final.token_ids[:] = [t for r in responses for t in r.token_ids]
            return final

        return await asyncio.gather(*(one(p) for p in prompts))


def metrics_of(mesh, name: str) -> str:
    log = mesh["children"][name].log_path.read_text(errors="replace")
    address = re.search(r"serving \S+ .*metrics=(\S+)", log).group(1)
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def test_a_shared_prefix_lands_on_the_same_replica_and_hits(mesh, tiny_model_dir):
    before = accepted(mesh)
    (first,) = asyncio.run(generate(mesh["router"], [SYSTEM + [11, 12, 13]]))
    after_first = accepted(mesh)
    holder = [i for i in range(2) if after_first[i] > before[i]]
    assert len(holder) == 1 and first.usage.cached_tokens == 0 and first.usage.prompt_tokens == 67
    for turn in range(3):
        prompt = SYSTEM + [20 + turn] * 5
        (again,) = asyncio.run(generate(mesh["router"], [prompt]))
        assert again.usage.cached_tokens == 64
        alone = run_json("--model", str(tiny_model_dir), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4")
        assert list(again.token_ids) == alone["token_ids"]
    after = accepted(mesh)
    assert after[holder[0]] - after_first[holder[0]] == 3 and after[1 - holder[0]] == after_first[1 - holder[0]]
    text = metrics_of(mesh, "ab"[holder[0]])
    hits = float(re.search(r'^moemesh_prefix_cache_hits_total\{service="attention"\} (\S+)', text, re.M).group(1))
    ratio = float(re.search(r'^moemesh_prefix_cache_hit_ratio\{service="attention"\} (\S+)', text, re.M).group(1))
    assert hits >= 3 * 64 and 0 < ratio < 1


def test_distinct_prompts_spread_over_both_replicas(mesh):
    before = accepted(mesh)
    asyncio.run(generate(mesh["router"], [[100 + i] * 40 for i in range(8)], max_new_tokens=8))
    after = accepted(mesh)
    assert all(a - b >= 2 for a, b in zip(after, before))


def test_a_busy_prefix_holder_gives_way(mesh):
    time.sleep(0.3)  # fresh load reports: nothing running
    before = accepted(mesh)
    finals = asyncio.run(generate(mesh["router"], [SYSTEM + [300 + i] * 3 for i in range(8)], max_new_tokens=16))
    after = accepted(mesh)
    gained = [a - b for a, b in zip(after, before)]
    assert sum(gained) == 8 and min(gained) >= 1  # imbalance 2: the holder does not take all 8 at once
    assert max(f.usage.cached_tokens for f in finals) == 64


def test_prompts_longer_than_the_budget_equal_moemesh_run(mesh, tiny_model_dir):
    ids = ",".join(str(t) for t in SYSTEM + [40, 41, 42] * 30)  # 154 tokens: 5 chunks of at most 32
    args = ["--prompt-ids", ids, "--max-new-tokens", "6"]  # --json asks for prompt logprobs: computed in chunks
    assert_same_generation(generate_json(mesh["router"], *args), run_json("--model", str(tiny_model_dir), *args))
