"""The expert server's dist links, driven by a `DistTransport` over a real gloo pair (both ranks here;
the transport's link is formed by the test instead of through OpenDistLink)."""
from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from expert_svc.dist_hub import CLIENT_RANK, DistHub
from moemesh.errors import MeshError
from moemesh.rpc.config import RpcConfig
from moemesh.transport.base import ExpertRequest
from moemesh.transport.dist_frames import FORWARD, parse_reply
from moemesh.transport.dist_link import INLINE_BYTES, DistLink, LinkBroken, connect_store, host_id, open_link, pair_group, start_store
from moemesh.transport.dist_transport import DistTransport

CPU = torch.device("cpu")
PEER = SimpleNamespace(server_id="hub", address="127.0.0.1:0", host_id="", dist_addr="127.0.0.1:0")
MAX_BYTES = 4 << 20


def handler(req: ExpertRequest) -> torch.Tensor:
    """layer 0: y[t] = sum of the weights of t's rows * x[t]; layer 1: a refused call; layer 2: a bug."""
    if req.layer == 1:
        raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"layer 1: experts {req.expert_ids.tolist()} are not held")
    if req.layer == 2:
        raise KeyError("bug")
    y = torch.zeros(req.x.shape, dtype=torch.float32)
    y.index_add_(0, req.token_idx.long(), req.weights[:, None] * req.x[req.token_idx.long()].float())
    return y.to(req.x.dtype)


@pytest.fixture
def hub():
    h = DistHub("127.0.0.1", 0, CPU, timeout_s=20, max_bytes=MAX_BYTES, handler=handler)
    yield h
    h.close()


def client_link(hub: DistHub) -> DistLink:
    link_id, secret = hub.open("test-client", host_id())
    store = connect_store(hub.addr, 20)
    link = open_link(store, link_id, CLIENT_RANK, "gloo", "127.0.0.1", CPU, 20, secret)
    link.store = store  # keep the store connection while the link lives
    return link


def transport(make_link, timeout_s: float = 20) -> DistTransport:
    """A DistTransport whose links come from `make_link()` (a link formed here, not via OpenDistLink)."""
    t = DistTransport(PEER, RpcConfig(max_message_mb=MAX_BYTES >> 20), timeout_s=timeout_s)
    t._open = make_link
    return t


def call(layer: int, x: torch.Tensor) -> ExpertRequest:
    """Every token once, weight 2 (layer 0 answers 2 x)."""
    t = x.shape[0]
    return ExpertRequest(layer, 1, x, torch.arange(t, dtype=torch.int32), torch.full((t,), 2.0), torch.tensor([0]), torch.tensor([t]))


def test_calls_small_and_large_errors_and_order(hub):
    client = transport(lambda: client_link(hub))
    try:
        small = torch.randn(16, 64)
        large = torch.randn(INLINE_BYTES // (64 * 4) + 5, 64)  # over the inline size: header, then payload
        torch.testing.assert_close(client.forward(call(0, small)).result(20), small * 2)
        torch.testing.assert_close(client.forward(call(0, large)).result(20), large * 2)
        # tokens read by several rows, one token by none
        rows = ExpertRequest(0, 1, small[:3], torch.tensor([0, 2, 0], dtype=torch.int32), torch.tensor([0.5, 1.0, 0.25]),
                             torch.tensor([3, 5]), torch.tensor([2, 1]))
        want = torch.stack([small[0] * 0.75, torch.zeros(64), small[2]])
        torch.testing.assert_close(client.forward(rows).result(20), want)
        bf = small.to(torch.bfloat16)
        assert torch.equal(client.forward(call(0, bf)).result(20), bf * 2)

        with pytest.raises(MeshError, match=r"expert server hub .*layer 1: experts \[0\] are not held") as e:
            client.forward(call(1, small)).result(20)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.server_id == "hub"
        with pytest.raises(MeshError, match="KeyError") as e:
            client.forward(call(2, small)).result(20)
        assert e.value.code == grpc.StatusCode.INTERNAL
        assert client._link.usable  # a failed call leaves the link in step

        # many callers at once: every reply goes to its own call
        xs = [torch.full((3, 64), float(i)) for i in range(40)]
        futs: dict[int, object] = {}

        def send(lo: int) -> None:
            for i in range(lo, 40, 4):
                futs[i] = client.forward(call(0, xs[i]))

        threads = [threading.Thread(target=send, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, x in enumerate(xs):
            torch.testing.assert_close(futs[i].result(20), x * 2)
    finally:
        client.close()


def test_malformed_frame_is_answered_and_the_link_goes_on(hub):
    link = client_link(hub)
    timeout = datetime.timedelta(seconds=20)
    link.send_frame([FORWARD, 0, 1, 1, 1, 2, 4, 1], [torch.zeros(5, dtype=torch.uint8)], timeout)
    code, message = parse_reply(*link.recv_frame(MAX_BYTES, timeout))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "payload has 5 bytes" in message
    link.send_frame([7], [], timeout)
    code, message = parse_reply(*link.recv_frame(MAX_BYTES, timeout))
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "kind 7" in message
    client = transport(lambda: link)
    try:
        x = torch.randn(2, 4)
        torch.testing.assert_close(client.forward(call(0, x)).result(20), x * 2)
    finally:
        client.close()


def wait_until(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_close_ends_the_servers_link_thread(hub):
    clients = [transport(lambda: client_link(hub)) for _ in range(2)]
    x = torch.randn(2, 4)
    for c in clients:
        c.forward(call(0, x)).result(20)
    assert hub.open_links == 2
    clients[0].close()
    assert wait_until(lambda: hub.open_links == 1)
    with pytest.raises(MeshError, match="transport closed") as e:
        clients[0].forward(call(0, x)).result(20)
    assert e.value.code == grpc.StatusCode.CANCELLED
    torch.testing.assert_close(clients[1].forward(call(0, x)).result(20), x * 2)
    clients[1].close()
    assert wait_until(lambda: hub.open_links == 0)


def test_a_frame_over_the_servers_limit_breaks_only_that_link(hub):
    small_hub = DistHub("127.0.0.1", 0, CPU, timeout_s=5, max_bytes=2 << 20, handler=handler)
    client = transport(lambda: client_link(small_hub), timeout_s=5)
    try:
        with pytest.raises(MeshError) as e:
            client.forward(call(0, torch.randn(3 << 20 >> 8, 64))).result(30)  # 3 MiB of x
        assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert not client._link.usable
        assert wait_until(lambda: small_hub.open_links == 0)
    finally:
        client.close()
        small_hub.close()
    other = transport(lambda: client_link(hub))  # the hub still opens links
    try:
        x = torch.randn(2, 4)
        torch.testing.assert_close(other.forward(call(0, x)).result(20), x * 2)
    finally:
        other.close()


@pytest.mark.slow  # waits out the link handshake: > 2 s
def test_an_outsider_without_the_link_secret_gets_no_link(hub, caplog):
    """The TCPStore is open to anyone who reaches it (its keys can be listed): joining a link's pair
    group there without the secret from OpenDistLink fails the handshake before any call (the hub
    refuses the proof and never answers); the hub goes on opening links for clients that know theirs."""
    link_id, _ = hub.open("victim", host_id())
    store = connect_store(hub.addr, 20)
    with pytest.raises(LinkBroken):
        open_link(store, link_id, CLIENT_RANK, "gloo", "127.0.0.1", CPU, 5, b"guessed-secret-0123456789abcdef")
    assert "the peer does not know the link's secret" in caplog.text
    client = transport(lambda: client_link(hub))
    try:
        x = torch.randn(2, 4)
        torch.testing.assert_close(client.forward(call(0, x)).result(20), x * 2)
    finally:
        client.close()


def test_closed_hub_opens_no_links(hub):
    hub.close()
    with pytest.raises(ValueError, match="stopping"):
        hub.open("late", host_id())
    other = DistHub("127.0.0.1", 0, CPU, 5, MAX_BYTES, handler)
    with pytest.raises(ValueError, match="not this server's node"):
        other.open("far", "elsewhere/boot")
    other.close()


def test_a_link_with_a_data_pair_sends_headers_and_payloads_apart(hub):
    """The layout of CUDA links (headers on the gloo control pair, payloads on the data pair, every
    operation in one order from the client's receiver thread), with a gloo data pair standing in
    for NCCL so it runs here; the server side is the hub's own answering loop."""
    store = start_store("127.0.0.1", 0, 20)
    addr = f"127.0.0.1:{store.port}"
    server_side: list[DistLink] = []

    def serve() -> None:
        pairs = [pair_group(store, name, 0, "gloo", "127.0.0.1", 20) for name in ("split", "split/data")]
        server_side.append(DistLink("split", pairs[0], 0, CPU, data=pairs[1]))
        hub._answer(server_side[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client_store = connect_store(addr, 20)
    pairs = [pair_group(client_store, name, CLIENT_RANK, "gloo", "127.0.0.1", 20) for name in ("split", "split/data")]
    link = DistLink("split", pairs[0], CLIENT_RANK, CPU, data=pairs[1])
    assert link.serial
    client = transport(lambda: link)
    small, large = torch.randn(16, 64), torch.randn(INLINE_BYTES // (64 * 4) + 5, 64)
    client.forward(call(0, small)).result(20)  # the first call forms the link (on the opener thread)
    futs = [client.forward(call(0, small)), client.forward(call(0, large)), client.forward(call(1, small)), client.forward(call(0, small))]
    torch.testing.assert_close(futs[0].result(20), small * 2)
    torch.testing.assert_close(futs[1].result(20), large * 2)
    with pytest.raises(MeshError) as e:
        futs[2].result(20)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    torch.testing.assert_close(futs[3].result(20), small * 2)
    client.close()
    thread.join(10)
    assert not thread.is_alive()  # CLOSE ended the answering loop
