from __future__ import annotations

import random

import pytest

from moemesh.tokenizer import IncrementalDetokenizer, Tokenizer

MULTIBYTE = ["东京是日本的首都。", "😀 🎉 🚀 🤖 👍🏽 🇫🇷", "Café naïve Zürich", "こんにちは世界", "Hello world, 안녕하세요!"]


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer.from_model_dir(tiny_tok_dir)


def _stream(tok, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


def test_random_ids_equal_full_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        deltas = _stream(tok, ids)
        assert "".join(deltas) == tok.decode(ids)


def test_multibyte_text_never_split(tok):
    for text in MULTIBYTE:
        ids = tok.encode(text)
        deltas = _stream(tok, ids)
        assert "".join(deltas) == text
        for d in deltas:
            assert "\ufffd" not in d
    # Byte-level BPE really splits these characters over several tokens.
    assert len(tok.encode("😀")) > 1


def test_continuation_after_prompt(tok):
    """Every cut at a character boundary: prompt text + streamed continuation == full text."""
    cuts = 0
    for text in MULTIBYTE + ["😀😀😀 🎉🎉 ab 东京东京 cd"]:
        ids = tok.encode(text)
        for cut in range(1, len(ids)):
            prompt, gen = ids[:cut], ids[cut:]
            if tok.decode(prompt).endswith("\ufffd"):
                continue
            cuts += 1
            out = "".join(_stream(tok, gen, prompt_ids=prompt))
            assert tok.decode(prompt) + out == text
    assert cuts > 20


def test_special_tokens_skipped(tok):
    ids = tok.encode("hi<|im_end|> there")
    assert "".join(_stream(tok, ids)) == "hi there"


def _metaspace_tokenizer_dir(tmp_path):
    """A SentencePiece-style (Metaspace) BPE: decoding a lone '▁world' token gives 'world' without its space."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    backend.train_from_iterator(["hello world the capital of France is Paris"] * 3, trainer)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>", "unk_token": "<unk>"}')
    return tmp_path


def test_sentencepiece_spaces(tmp_path):
    tok = Tokenizer.from_model_dir(_metaspace_tokenizer_dir(tmp_path))
    text = "hello world the capital of France is Paris"
    ids = tok.encode(text)
    assert tok.decode(ids[1:2]) != " " + tok.decode(ids[1:2]).lstrip()  # a lone token loses its space
    deltas = _stream(tok, ids)
    assert "".join(deltas) == text
    prompt, gen = ids[:2], ids[2:]
    assert tok.decode(prompt) + "".join(_stream(tok, gen, prompt_ids=prompt)) == text
