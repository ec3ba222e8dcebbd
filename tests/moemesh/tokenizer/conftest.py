from __future__ import annotations

import pytest

from tests.fixtures.tokenizers import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_tok_dir(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))
