import pytest

from tests.moemesh.models.arch.reference import make_checkpoint


@pytest.fixture(scope="session")
def deepseek_ckpt(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"))
