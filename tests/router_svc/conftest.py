import pytest

from moemesh.contracts.info import ModelInfo
from tests.fixtures.tokenizers import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from moemesh.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def info():
    return ModelInfo(name="tiny", architecture="MixtralForCausalLM", vocab_size=512, max_context=64,
                     max_new_tokens_limit=32, eos_token_ids=(2,), has_chat_template=True)
