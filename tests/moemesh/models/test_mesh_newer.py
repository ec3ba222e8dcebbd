"""The newer families through the whole mesh (control, 2 expert servers, attention, router as processes on
loopback, as `moemesh up` starts them; prompt chunks of 24 tokens) vs transformers (float32): the three
prompts at once (the 70-token one past every DSA index_topk and over three chunks; the hybrid models'
recurrent state carried across them and across the step loop's continuous batching), prompt logprobs
within 1e-4 and greedy continuations identical up to the tokenizer's EOS (which the mesh stops at).
A chat request's `chat_template_kwargs` reach a tiny template holding each family's switch (`thinking`
for DeepSeek-V3.2 and Kimi-K2.5, `enable_thinking` for GLM-5 and the Qwen models, `reasoning_effort`
for MiniMax-M2); the multimodal checkpoints (Kimi-K2.5 as transformers saves it and as published, Qwen3.5-MoE
VL: experts read through their nested names on the expert servers) refuse an image placeholder with
INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from moemesh.launcher.mesh import Mesh, MeshSpec
from moemesh.rpc.generation import Completion, build_request
from moemesh.tokenizer import Tokenizer
from tests.fixtures.services import gen_grpc
from tests.fixtures.tokenizers import make_tiny_tokenizer
from tests.moemesh.models.arch.reference import assert_logprobs_close
from tests.moemesh.models.tiny_families import GREEDY_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

EOS = 2  # the tiny tokenizer's <|im_end|>
PLACEHOLDER = 300  # image placeholder id moved into the tiny vocabulary
# checkpoint (every engine-served variant of tiny_families, as test_run_cli_newer.py) -> the chat template
# variable its family's templates switch reasoning with
SWITCH = {"deepseek_v32": "thinking", "deepseek_v32_plain": "thinking", "glm_moe_dsa": "enable_thinking",
          "glm_moe_dsa_pattern": "enable_thinking", "minimax_m2": "reasoning_effort",
          "minimax_m2_full_rope": "reasoning_effort", "kimi_k25": "thinking", "kimi_k25_published": "thinking",
          "qwen3_next": "enable_thinking", "qwen3_next_plain": "enable_thinking", "qwen3_5_moe": "enable_thinking",
          "qwen3_5_moe_vl": "enable_thinking"}
MULTIMODAL = {"kimi_k25": ("image_token_id",), "kimi_k25_published": ("image_token_id", "media_placeholder_token_id"),
              "qwen3_5_moe_vl": ("image_token_id",)}


def template(switch: str) -> str:
    """ChatML whose assistant header shows `switch` when a request sets it."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        f"{{% if {switch} is defined %}}{{{{ '[{switch}=' ~ {switch} ~ ']' }}}}{{% endif %}}"
        "{% endif %}"
    )


@pytest.fixture(scope="module", params=list(SWITCH))
def served(request, build_family, tmp_path_factory):
    name = request.param
    path, _, expected = build_family(name)
    model_dir = tmp_path_factory.mktemp(f"mesh-{name}")
    shutil.copytree(path, model_dir, dirs_exist_ok=True)
    make_tiny_tokenizer(model_dir)
    (model_dir / "chat_template.jinja").write_text(template(SWITCH[name]))
    if name in MULTIMODAL:
        config = json.loads((model_dir / "config.json").read_text())
        config.update({field: PLACEHOLDER for field in MULTIMODAL[name]})
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    mesh = Mesh(MeshSpec(model_dir=str(model_dir), expert_servers=2, max_num_batched_tokens=24, start_timeout_s=240,
                         grace_s=5), tmp_path_factory.mktemp("mesh-logs"))
    mesh.start()
    yield name, model_dir, mesh, expected
    mesh.stop()


async def generate_all(address: str, requests) -> list[Completion]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = gen_grpc.GenerationStub(ch)

        async def one(req) -> Completion:
            done = Completion()
            async for resp in stub.Generate(req, timeout=300):
                done.add(resp)
            return done

        return await asyncio.gather(*(one(r) for r in requests))


def test_concurrent_prompts_match_transformers(served):
    _, _, mesh, expected = served
    reqs = [build_request(prompt_token_ids=list(p), max_new_tokens=GREEDY_TOKENS, temperature=0.0, logprobs=True,
                          prompt_logprobs=True) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, asyncio.run(generate_all(mesh.router_addr, reqs))):
        ref_plp, ref_tokens = expected[prompt]
        assert out.prompt_token_ids == list(prompt)
        assert_logprobs_close(out.prompt_logprobs, ref_plp)
        assert out.token_ids == (ref_tokens[: ref_tokens.index(EOS) + 1] if EOS in ref_tokens else ref_tokens)


def test_chat_template_kwargs_reach_the_template(served):
    name, model_dir, mesh, _ = served
    switch = SWITCH[name]
    value = '"low"' if switch == "reasoning_effort" else "false"
    plain = build_request(messages=[("user", "Hi")], max_new_tokens=1, temperature=0.0)
    switched = build_request(messages=[("user", "Hi")], max_new_tokens=1, temperature=0.0)
    switched.chat_template_kwargs[switch] = value
    outs = asyncio.run(generate_all(mesh.router_addr, [plain, switched]))
    tok = Tokenizer.from_model_dir(model_dir)
    shown = "low" if switch == "reasoning_effort" else "False"
    assert tok.decode(outs[0].prompt_token_ids, skip_special_tokens=False) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(outs[1].prompt_token_ids, skip_special_tokens=False) == f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n[{switch}={shown}]"


@pytest.mark.parametrize("served", list(MULTIMODAL), indirect=True, scope="module")  # the same meshes as above
def test_image_placeholder_is_refused(served):
    _, _, mesh, _ = served
    req = build_request(prompt_token_ids=[5, PLACEHOLDER, 7], max_new_tokens=2, temperature=0.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(generate_all(mesh.router_addr, [req]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.value.details() and "placeholder" in err.value.details()
