import pytest

from gateway_svc.config import GatewayConfig
from gateway_svc.server import create_server
from tests.fixtures.loop_thread import LoopThread
from tests.gateway_svc.fake_router import FakeRouter, script


class Running:
    """A gateway in front of the fake router, both on a loop thread."""

    def __init__(self, loop: LoopThread, **flags) -> None:
        self.loop = loop
        self.router = FakeRouter()
        address = loop.run(self.router.start(), 30)
        self.server, self.port = loop.run(create_server(GatewayConfig(router=address, **flags)), 30)
        loop.run(self.server.start(), 30)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def fake(self):
        return self.router.servicer

    def reset(self, responses=None, error=None, delay_s=0.0, fail_after=None) -> None:
        f = self.fake
        f.responses = responses if responses is not None else script("Hello", " world")
        f.error, f.delay_s, f.fail_after = error, delay_s, fail_after
        f.requests.clear()
        f.cancelled = f.finished = 0

    def close(self) -> None:
        self.loop.run(self.server.shutdown(), 30)
        self.loop.run(self.router.stop(), 30)


@pytest.fixture(scope="module")
def loop():
    with LoopThread("gateway-tests") as lt:
        yield lt


@pytest.fixture(scope="module")
def gateway(loop):
    g = Running(loop)
    yield g
    g.close()


@pytest.fixture
def gw(gateway):
    """The module's gateway with the fake router reset to its default script."""
    gateway.reset()
    return gateway
