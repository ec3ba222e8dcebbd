import pytest

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.tokenizers import make_tiny_tokenizer


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Mixtral (8 experts, top-2, 2 layers, float32) with the tiny ChatML tokenizer."""
    path = tmp_path_factory.mktemp("tiny-mixtral")
    make_tiny_checkpoint("mixtral", path)
    make_tiny_tokenizer(path)
    return path


from tests.fixtures.expert_servers import loop, moe_dir  # noqa: E402,F401  (pytest fixtures)
