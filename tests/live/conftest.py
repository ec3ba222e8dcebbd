import pytest

from tests.live.skewed import make_skewed_checkpoint


@pytest.fixture(scope="package")
def skewed_model(tmp_path_factory):
    """The tiny float32 Mixtral whose router favours experts 0 and 2 (see skewed.py)."""
    return make_skewed_checkpoint(tmp_path_factory.mktemp("skewed-mixtral"))
