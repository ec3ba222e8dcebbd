import pytest

from moemesh.rpc.loop_thread import LoopThread
from tests.expert_svc.fixtures import tiny_moe_dir


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    return tiny_moe_dir(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def loop():
    lt = LoopThread("test-loop")
    yield lt
    lt.close()
