"""The whole mesh (control, N expert servers, attention, router) as real processes on loopback:
greedy output through the mesh equals `moemesh run` for 1, 2 and 3 expert servers, over the gRPC
and the torch.distributed transport, with experts as stored, in bf16 and in fp8."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from moemesh.launcher.mesh import Mesh, MeshSpec
from moemesh.rpc.generation import build_request
from tests.fixtures.services import assert_same_generation, gen_grpc, generate_json, run_json, wait_idle

MESHES = [
    pytest.param((1, "grpc", None), id="1-expert-grpc"),
    pytest.param((2, "grpc", None), id="2-experts-grpc"),
    pytest.param((3, "grpc", "bf16"), id="3-experts-grpc-bf16"),
    pytest.param((2, "dist", None), id="2-experts-dist"),
    pytest.param((3, "dist", "fp8"), id="3-experts-dist-fp8"),
]


@pytest.fixture(scope="module", params=MESHES)
def mesh(request, tiny_model_dir, tmp_path_factory):
    servers, transport, dtype = request.param
    spec = MeshSpec(model_dir=str(tiny_model_dir), expert_servers=servers, transport=transport,
                    experts_dtype=dtype, start_timeout_s=180, grace_s=5)
    m = Mesh(spec, tmp_path_factory.mktemp("mesh-logs"))
    m.start()
    yield m
    m.stop()


def dtype_flags(mesh):
    return ["--experts-dtype", mesh.spec.experts_dtype] if mesh.spec.experts_dtype else []


@pytest.mark.parametrize("prompt", [["--prompt", "What is the capital of France?"], ["--prompt-ids", "5,17,300,42,7"]])
def test_greedy_output_equals_moemesh_run(mesh, tiny_model_dir, prompt):
    args = [*prompt, "--max-new-tokens", "10"]
    expected = run_json("--model", str(tiny_model_dir), *args, *dtype_flags(mesh))
    assert_same_generation(generate_json(mesh.router_addr, *args), expected)


def test_32_concurrent_streams_complete_with_correct_results(mesh, tiny_model_dir):
    prompts = [[5 + i, 40 + 3 * i, 100 + i] for i in range(32)]
    expected = [run_json("--model", str(tiny_model_dir), "--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", "6",
                         *dtype_flags(mesh))["token_ids"] for p in prompts[:4]]

    async def main():
        async with grpc.aio.insecure_channel(mesh.router_addr) as ch:
            stub = gen_grpc.GenerationStub(ch)

            async def one(p):
                req = build_request(prompt_token_ids=p, max_new_tokens=6, temperature=0.0, prompt_logprobs=False)
                return [t async for r in stub.Generate(req, timeout=300) for t in r.token_ids]

            return await asyncio.gather(*(one(p) for p in prompts))

    results = asyncio.run(main())
    assert all(1 <= len(r) <= 6 for r in results)
    assert results[:4] == expected
    load = wait_idle(mesh.addresses["attention-0"], rpc=mesh.rpc)  # the mesh's own token
    assert (load.running, load.free_blocks) == (0, load.total_blocks)
