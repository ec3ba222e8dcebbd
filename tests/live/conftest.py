import pytest

from tests.live.skewed import make_skewed_checkpoint


@pytest.fixture(scope="package")
def skewed_model(tmp_path_factory):
    """The tiny float32 Mixtral whose router favours experts 0 and 2 (see skewed.py)."""
    return make_skewed_checkpoint(tmp_path_factory.mktemp("skewed-mixtral"))


@pytest.fixture(autouse=True)
def mesh_token(monkeypatch):
    """`moemesh ctl` run in this process calls the live meshes' control plane with the test token."""
    from tests.fixtures.auth import TEST_TOKEN

    monkeypatch.setenv("MOEMESH_MESH_TOKEN", TEST_TOKEN)
