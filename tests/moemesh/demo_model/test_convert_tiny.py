"""GGUF -> Mixtral conversion on a tiny random llama written the way llama.cpp writes it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from moemesh.demo_model import build_demo_model, is_complete
from moemesh.demo_model.gguf_source import permute_rope_rows, unpermute_rope_rows
from moemesh.tokenizer import Tokenizer
from tests.fixtures.tiny_gguf import llamacpp_permute

TEXTS = ["Hello world", "The capital of France is Paris.", "东京 😀 Café", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("n_heads, head_dim", [(3, 64), (9, 64), (4, 16), (2, 8)])
def test_unpermute_inverts_llamacpp_permutation(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 5)).astype(np.float32)
    permuted = torch.from_numpy(np.ascontiguousarray(llamacpp_permute(w, n_heads)))
    assert not torch.equal(permuted, torch.from_numpy(w))
    assert torch.equal(unpermute_rope_rows(permuted, n_heads), torch.from_numpy(w))
    assert torch.equal(permute_rope_rows(torch.from_numpy(w), n_heads), permuted)


def test_unpermute_rejects_bad_rows():
    with pytest.raises(ValueError, match="n_heads"):
        unpermute_rope_rows(torch.zeros(10, 4), 3)


def test_converted_mixtral_matches_reference_llama(tiny_gguf, tmp_path):
    import transformers

    path, llama, _ = tiny_gguf
    out = build_demo_model(tmp_path / "m", gguf_path=path)
    moe = transformers.MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_local_experts"] == 8 and cfg["num_experts_per_tok"] == 8 and cfg["intermediate_size"] == 16
    assert cfg["tie_word_embeddings"] is False and cfg["rope_parameters"]["rope_theta"] == 10000.0
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(moe(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)


def test_tokenizer_rebuilt_from_gguf_matches_source(tiny_gguf, tmp_path):
    path, _, tok_dir = tiny_gguf
    out = build_demo_model(tmp_path / "m", gguf_path=path)
    ours, source = Tokenizer.from_model_dir(out), Tokenizer.from_model_dir(tok_dir)
    for text in TEXTS:
        ids = source.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=False) == source.decode(ids, skip_special_tokens=False)
    assert ours.eos_token_ids == [2] and ours.bos_token_id == 0 and ours.vocab_size == 512
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_bfloat16_checkpoint(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    out = build_demo_model(tmp_path / "m", dtype="bfloat16", gguf_path=path)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert is_complete(out, "bfloat16") and not is_complete(out, "float32")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_idempotent_and_force(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    messages: list[str] = []
    out = build_demo_model(tmp_path / "m", gguf_path=path, progress=messages.append)
    assert any("converting layer 2/2" in m for m in messages)
    stamp = os.stat(out / "model.safetensors").st_mtime_ns
    messages.clear()
    assert build_demo_model(out, gguf_path=path, progress=messages.append) == out
    assert any("skipping" in m for m in messages)
    assert os.stat(out / "model.safetensors").st_mtime_ns == stamp
    inode = os.stat(out / "model.safetensors").st_ino
    build_demo_model(out, gguf_path=path, force=True)
    assert os.stat(out / "model.safetensors").st_ino != inode
    assert is_complete(out, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left behind


def test_failed_build_leaves_existing_model_untouched(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    out = build_demo_model(tmp_path / "m", gguf_path=path)
    before = (out / "model.safetensors").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(Exception):
        build_demo_model(out, gguf_path=bad, force=True)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "m"]


def test_failed_build_creates_nothing(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF garbage")
    with pytest.raises(Exception):
        build_demo_model(tmp_path / "m", gguf_path=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_refuses_to_replace_a_non_model_directory(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no model"):
        build_demo_model(tmp_path / "data", gguf_path=path)
    assert (tmp_path / "data" / "notes.txt").read_text() == "keep me"


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        build_demo_model(tmp_path / "m", dtype="float16")


def test_concurrent_build_keeps_the_first_copy(tiny_gguf, tmp_path, monkeypatch):
    """If another process completes the model while this one converts, its copy stays in place."""
    import shutil

    import moemesh.demo_model.build as build

    path, _, _ = tiny_gguf
    other = build_demo_model(tmp_path / "other", gguf_path=path)
    out = tmp_path / "m"
    real_convert = build.convert_gguf_to_mixtral

    def convert_while_another_finishes(*args, **kwargs):
        result = real_convert(*args, **kwargs)
        shutil.copytree(other, out)
        return result

    monkeypatch.setattr(build, "convert_gguf_to_mixtral", convert_while_another_finishes)
    messages: list[str] = []
    assert build_demo_model(out, gguf_path=path, progress=messages.append) == out
    assert any("built concurrently" in m for m in messages)
    assert is_complete(out, "float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "other"]
