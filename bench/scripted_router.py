"""A scripted `moemesh.v1.Generation` server for bench/gateway_overhead.py: every Generate answers
`max_new_tokens` one-token messages (one every `step_s`), then the final message with usage; no
model, so what a client or gateway in front of it spends is all that is measured. Each call's
arrival (time.perf_counter, the machine's monotonic clock) and first prompt ids go to a file, one
line per call.

    python -m bench.scripted_router STEP_S ARRIVALS_FILE    # prints its port once it serves
"""
from __future__ import annotations

import asyncio
import sys
import time

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.generation import SERVICE_NAME, pb, pb_grpc
from moemesh.rpc.security import api_key_credential
from moemesh.rpc.server import SERVING, Service, build_server

KEY_IDS = 8  # prompt ids written with each arrival: enough to tell a bench's random prompts apart


class ScriptedGeneration:
    def __init__(self, step_s: float, arrivals) -> None:
        self.step_s = step_s
        self.arrivals = arrivals  # a text file, line-buffered

    async def Generate(self, request, context):
        ids = list(request.prompt_token_ids.ids)[:KEY_IDS]
        self.arrivals.write(f"{time.perf_counter()} {' '.join(map(str, ids))}\n")
        n = request.max_new_tokens
        for i in range(n):
            await asyncio.sleep(self.step_s)
            yield pb.GenerateResponse(text="ab ", token_ids=[100 + i])
        yield pb.GenerateResponse(finish_reason="length", usage=pb.Usage(prompt_tokens=len(request.prompt_token_ids.ids), completion_tokens=n))

    async def Abort(self, request, context):
        return pb.AbortResponse(found=False)

    async def CountTokens(self, request, context):
        return pb.TokenCount(prompt_tokens=len(request.prompt_token_ids.ids))

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(name="scripted", architecture="none", vocab_size=1000, max_context=1 << 20,
                            max_new_tokens_limit=1 << 20)


async def serve(step_s: float, arrivals_path: str) -> None:
    with open(arrivals_path, "a", buffering=1) as arrivals:
        server = build_server(RpcConfig(), Service(pb_grpc.add_GenerationServicer_to_server, ScriptedGeneration(step_s, arrivals), SERVICE_NAME),
                              credential=api_key_credential(""))
        port = server.bind("127.0.0.1:0")
        await server.start()
        await server.health.set(SERVICE_NAME, SERVING)
        print(port, flush=True)
        await server.wait_for_termination()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    asyncio.run(serve(float(sys.argv[1]), sys.argv[2]))
