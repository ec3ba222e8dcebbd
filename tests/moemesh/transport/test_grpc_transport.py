"""`GrpcTransport` against real expert servers: many calls on one ForwardStream, a failed call does
not end it, a deadline or a dead server fails the calls waiting and the next call opens a new stream."""
import time
import types

import grpc
import pytest
import torch

from moemesh.errors import MeshError
from moemesh.transport.grpc_transport import GrpcTransport
from tests.fixtures.auth import TEST_RPC
from tests.fixtures.expert_servers import all_weights, expected, loop, routed_request, running_expert_servers  # noqa: F401


def transport_to(srv, timeout_s=20.0):
    peer = types.SimpleNamespace(server_id="s0", address=f"127.0.0.1:{srv.port}", host_id="", dist_addr="")
    return GrpcTransport(peer, TEST_RPC, timeout_s)


def test_calls_in_flight_together_share_one_stream_and_a_failed_call_does_not_end_it(tiny_model_dir, loop):
    _, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all") as (srv,):
        t = transport_to(srv)
        try:
            calls = [routed_request(6 + i, [0, 3, 5], layer=1, seed=i) for i in range(4)]
            futs = [t.forward(req) for req in calls]  # all in flight at once
            for req, fut in zip(calls, futs):
                torch.testing.assert_close(fut.result(30), expected(req, weights[1]))
            stream = t._stream
            with pytest.raises(MeshError, match="layer: 9") as e:
                t.forward(routed_request(6, [0, 3, 5], layer=9)).result(30)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.server_id == "s0"
            torch.testing.assert_close(t.forward(calls[0]).result(30), expected(calls[0], weights[1]))
            assert t._stream is stream  # the same stream went on
        finally:
            t.close()


def test_a_call_past_its_deadline_fails_and_the_next_opens_a_new_stream(tiny_model_dir, loop):
    _, weights = all_weights(tiny_model_dir)
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all", inline_max_elements=0) as (srv,):
        t = transport_to(srv, timeout_s=0.5)
        real = srv.shard.forward
        srv.shard.forward = lambda *a: (time.sleep(1.5), real(*a))[1]
        try:
            req = routed_request(5, [2])
            with pytest.raises(MeshError, match="no answer within") as e:
                t.forward(req).result(30)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            first = t._stream
            srv.shard.forward = real
            time.sleep(1.5)  # the slow call ends on the server
            torch.testing.assert_close(t.forward(req).result(30), expected(req, weights[0]))
            assert t._stream is not first
        finally:
            t.close()


def test_a_server_that_goes_away_fails_the_calls_with_unavailable(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all") as (srv,):
        t = transport_to(srv)
        try:
            req = routed_request(5, [2])
            t.forward(req).result(30)
            loop.run(srv.mesh.stop(0), 30)
            with pytest.raises(MeshError) as e:
                t.forward(req).result(30)
            assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        finally:
            t.close()


def test_close_fails_the_waiting_calls_with_cancelled_and_stops_the_stream(tiny_model_dir, loop):
    with running_expert_servers(tiny_model_dir, 1, loop, transport="grpc", preload="all", inline_max_elements=0) as (srv,):
        t = transport_to(srv)
        real = srv.shard.forward
        srv.shard.forward = lambda *a: (time.sleep(1.0), real(*a))[1]
        try:
            fut = t.forward(routed_request(5, [2]))
            stream = t._stream
            time.sleep(0.2)  # the call is on the server now
            t.close()
            with pytest.raises(MeshError, match="transport closed") as e:
                fut.result(30)
            assert e.value.code == grpc.StatusCode.CANCELLED
            assert stream.broken is not None and stream.broken.code == grpc.StatusCode.CANCELLED
        finally:
            srv.shard.forward = real
            t.close()
