import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.rpc.protos import load
from moemesh.rpc.server import make_channel
from moemesh.transport.codec import decode
from moemesh.transport.grpc_transport import request_message
from tests.fixtures.auth import TEST_RPC, token_env
from tests.fixtures.expert_servers import routed_request, running_expert_servers

expert_pb2, expert_grpc = load("expert")
control_pb2, control_grpc = load("control")
REPO = Path(__file__).resolve().parents[2]


def test_drain_finishes_in_flight_calls_and_refuses_new_ones(tiny_model_dir, loop):
    # on the compute pool (inline_max_elements=0): an inline call holds the event loop, so drain
    # would only start once it is done
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all", inline_max_elements=0) as (srv,):
        release = threading.Event()
        real = srv.shard.forward

        def slow_forward(*args):
            release.wait(10)
            return real(*args)

        srv.shard.forward = slow_forward
        req = routed_request(8, [1, 2])

        async def one_call(ch):
            return [r async for r in expert_grpc.ExpertServiceStub(ch).ForwardStream(iter([request_message(req)]), timeout=20)][0]

        async def scenario():
            async with make_channel(f"127.0.0.1:{srv.port}", TEST_RPC) as ch:
                call = asyncio.ensure_future(one_call(ch))
                while srv.shard.stats.in_flight == 0:
                    await asyncio.sleep(0.01)
                draining = asyncio.ensure_future(srv.drain(10))
                await asyncio.sleep(0.2)
                status = (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())).status
                assert not draining.done()  # waits for the call in flight
                release.set()
                y = decode((await call).y)
                await draining
                return status, y

        status, y = loop.run(scenario(), 30)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert y.shape == req.x.shape

        async def after():
            async with make_channel(f"127.0.0.1:{srv.port}", TEST_RPC) as ch:
                await expert_grpc.ExpertServiceStub(ch).GetStats(expert_pb2.GetStatsRequest(), timeout=2)

        with pytest.raises(grpc.aio.AioRpcError) as e:
            loop.run(after(), 10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def spawn(args):
    env = dict(token_env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if " serving " not in line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{args[0]} did not start: {line!r}")
    return proc, line.split()


def stop(proc, timeout_s=20):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.slow  # an expert server as a process
def test_sigterm_drains_and_deregisters_an_expert_server_process(tiny_model_dir, loop):
    control, words = spawn(["control_svc", "--model-dir", str(tiny_model_dir), "--expected-expert-servers", "1"])
    control_addr = words[3]
    expert = None
    try:
        expert, words = spawn(["expert_svc", "--model-dir", str(tiny_model_dir), "--control-addr", control_addr, "--transport", "grpc", "--drain-timeout-s", "5"])
        server_id = words[-1].removeprefix("id=")

        async def placement_version():
            async with make_channel(control_addr, TEST_RPC) as ch:
                stub = control_grpc.ControlServiceStub(ch)
                for _ in range(200):
                    p = await stub.GetPlacement(control_pb2.GetPlacementRequest())
                    if p.placement.version:
                        return p
                    await asyncio.sleep(0.05)

        update = loop.run(placement_version(), 30)
        assert [s.server_id for s in update.servers] == [server_id]
        started = time.monotonic()
        assert stop(expert) == 0
        assert time.monotonic() - started < 5 + 5

        async def known():
            async with make_channel(control_addr, TEST_RPC) as ch:
                return (await control_grpc.ControlServiceStub(ch).Heartbeat(control_pb2.HeartbeatRequest(id=server_id))).known

        assert loop.run(known(), 10) is False  # deregistered
    finally:
        if expert is not None:
            stop(expert)
        assert stop(control) == 0


def test_decode_sized_calls_run_on_the_event_loop_and_larger_ones_on_the_pool(tiny_model_dir, loop):
    from tests.fixtures.expert_servers import HIDDEN

    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all", inline_max_elements=4 * HIDDEN) as (srv,):
        ran_on, real = [], srv.shard.forward

        def recording_forward(*args):
            ran_on.append(threading.current_thread().name)
            return real(*args)

        srv.shard.forward = recording_forward

        async def call(rows):
            req = routed_request(rows, [1], top_k=1)  # `rows` rows, one per token
            async with make_channel(f"127.0.0.1:{srv.port}", TEST_RPC) as ch:
                stub = expert_grpc.ExpertServiceStub(ch)
                y = decode([r async for r in stub.ForwardStream(iter([request_message(req)]), timeout=20)][0].y)
            assert y.shape == req.x.shape

        loop.run(call(4), 30)  # 4 rows * HIDDEN: inline
        loop.run(call(5), 30)
        assert ran_on[0] == loop.thread.name
        assert ran_on[1].startswith("expert-compute")


def test_drain_does_not_wait_out_an_idle_forward_stream(tiny_model_dir, loop):
    import types

    from moemesh.errors import MeshError
    from moemesh.transport.grpc_transport import GrpcTransport

    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all") as (srv,):
        peer = types.SimpleNamespace(server_id="s0", address=f"127.0.0.1:{srv.port}", host_id="", dist_addr="")
        t = GrpcTransport(peer, TEST_RPC, timeout_s=20)
        try:
            req = routed_request(4, [1])
            t.forward(req).result(30)  # the stream is open and idle now
            started = time.monotonic()
            loop.run(srv.drain(20), 30)
            assert time.monotonic() - started < 5  # not the 20 s drain timeout
            with pytest.raises(MeshError):
                t.forward(req).result(30)
        finally:
            t.close()
