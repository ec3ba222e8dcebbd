import pytest

from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.tokenizers import make_tiny_tokenizer


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mixtral")
    make_tiny_checkpoint("mixtral", path)
    make_tiny_tokenizer(path)
    return path
