"""An attention replica whose step loop ends does not look healthy: health NOT_SERVING, its streams
end UNAVAILABLE, and the process exits non-zero (so it is restarted)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attention_svc.config import AttentionConfig
from attention_svc.server import create_server
from moemesh.engine import EngineConfig
from moemesh.errors import ServiceFailed
from moemesh.rpc.protos import load
from tests.fixtures.auth import TEST_RPC, aio_channel, token_env

att_pb, att_grpc = load("attention")


async def health(channel) -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status


@pytest.mark.parametrize("how", ["cancelled", "raises"])
def test_a_dead_step_loop_turns_health_not_serving_and_ends_its_streams(tiny_model_dir, how):
    async def main():
        cfg = AttentionConfig(engine=EngineConfig(model_dir=str(tiny_model_dir), kv_cache_tokens=512), rpc=TEST_RPC)
        server, port = await create_server(cfg)
        await server.start()
        try:
            async with aio_channel(f"127.0.0.1:{port}") as ch:
                assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
                stub = att_grpc.AttentionStub(ch)
                call = stub.Generate(att_pb.SequenceRequest(request_id="s", prompt_token_ids=[5, 6], max_new_tokens=200,
                                                            ignore_eos=True, temperature=0.0), timeout=60)
                await call.read()
                if how == "cancelled":
                    server._loop_task.cancel()
                else:  # every iteration fails outside the engine step until the loop gives up
                    def broken():
                        raise RuntimeError("placement state corrupt")
                    server.replica.loop.between_steps = broken
                with pytest.raises(ServiceFailed, match="the engine step loop stopped"):
                    await asyncio.wait_for(server.serve_until(asyncio.Event()), 10)
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while True:
                        msg = await call.read()
                        assert msg is not grpc.aio.EOF, "the stream ended without an error"
                deadline = time.monotonic() + 5
                while await health(ch) != health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, "health still SERVING"
                    await asyncio.sleep(0.05)
                load = await stub.GetLoad(att_pb.GetLoadRequest(), timeout=5)
                return ended.value, load
        finally:
            await server.shutdown(0)

    ended, load = asyncio.run(main())
    assert ended.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
    assert not load.serving


@pytest.mark.slow  # a replica as a process
def test_the_process_exits_non_zero_when_its_step_loop_ends(tiny_model_dir):
    script = textwrap.dedent(f"""
        import sys
        import attention_svc.step_loop as step_loop

        async def broken(self):
            raise RuntimeError("broken on purpose")

        step_loop.StepLoop.run = broken
        from moemesh.cli.main import main
        sys.exit(main(["serve", "attention", "--model-dir", {str(tiny_model_dir)!r}, "--kv-cache-tokens", "512"]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=token_env())
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "moemesh serve attention: error: attention: the engine step loop stopped (RuntimeError: broken on purpose)"
