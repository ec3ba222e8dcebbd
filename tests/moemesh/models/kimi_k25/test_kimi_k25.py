"""Kimi-K2.5: its DeepSeek-V3 language model served from the multimodal checkpoint (as transformers
saves it, and in the published layout) matches transformers' Kimi_K25ForConditionalGeneration on text;
a prompt holding the image/video placeholder is refused with a message naming the field."""
from __future__ import annotations

import pytest

from moemesh.config import ConfigError
from moemesh.models.registry import parse_model_config
from moemesh.engine.sampling_params import SamplingParams
from moemesh.models.deepseek_v3.model import DeepseekV3ForCausalLM
from tests.moemesh.models.arch.engine_helpers import make_engine
from tests.moemesh.models.engine_vs_transformers import check_engine_matches
from tests.moemesh.models.tiny_families import tiny_config


@pytest.mark.parametrize("family_checkpoint", ["kimi_k25", "kimi_k25_published"], indirect=True)
def test_language_model_matches_transformers(family_checkpoint):
    check_engine_matches(family_checkpoint)


@pytest.mark.parametrize("family_checkpoint", ["kimi_k25_published"], indirect=True)
def test_published_layout_serves_the_deepseek_v3_text_model(family_checkpoint):
    path, _, _ = family_checkpoint
    engine = make_engine(path)
    assert isinstance(engine.model, DeepseekV3ForCausalLM)
    assert engine.model_config.media_token_ids == (163605, 163840)
    assert not engine.model_config.tie_word_embeddings


def raw(**overrides) -> dict:
    d = tiny_config("kimi_k25").to_dict()
    d.update(architectures=["KimiK25ForConditionalGeneration"], **overrides)
    return d


def test_config_is_the_text_model_with_the_media_tokens():
    d = raw(image_token_id=300, video_token_id=301, tie_word_embeddings=False)
    cfg = parse_model_config(d)
    assert cfg.architecture == "KimiK25ForConditionalGeneration"
    assert (cfg.num_layers, cfg.num_experts, cfg.media_token_ids, cfg.tie_word_embeddings) == (3, 16, (300, 301), False)
    assert parse_model_config(raw()).tie_word_embeddings  # transformers' Kimi_K25Config ties by default


def test_media_placeholder_in_a_prompt_is_refused_in_vocabulary(tmp_path):
    """With placeholders inside the vocabulary, the refusal is the placeholder's, not the vocabulary's."""
    from tests.moemesh.models.tiny_families import make_checkpoint
    import json

    path, _ = make_checkpoint("kimi_k25", tmp_path / "k")
    config = json.loads((path / "config.json").read_text())
    config.update(image_token_id=300, video_token_id=301)
    (path / "config.json").write_text(json.dumps(config))
    engine = make_engine(path)
    for token in (300, 301):
        with pytest.raises(ValueError, match="image/video placeholder"):
            engine.add_request(f"r{token}", [5, token], SamplingParams(max_new_tokens=2))
    engine.add_request("text", [5, 299], SamplingParams(max_new_tokens=2))


def test_int4_compressed_tensors_checkpoint_is_refused():
    d = raw(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(ConfigError, match="quantization_config"):
        parse_model_config(d)


def test_public_api_carries_no_images():
    """The generation API takes text, token ids or chat messages whose content is one string: no field of
    any message a request can hold is bytes. An image reaches a model only as its placeholder token,
    which is refused above."""
    from google.protobuf.descriptor import FieldDescriptor

    from moemesh.rpc.protos import load

    generation_pb2, _ = load("generation")
    seen, todo = set(), [generation_pb2.GenerateRequest.DESCRIPTOR]
    while todo:
        desc = todo.pop()
        if desc.full_name in seen:
            continue
        seen.add(desc.full_name)
        for f in desc.fields:
            assert f.type != FieldDescriptor.TYPE_BYTES, f"{desc.name}.{f.name}"
            if f.message_type is not None:
                todo.append(f.message_type)
    assert "moemesh.v1.ChatMessage" in seen
    assert generation_pb2.ChatMessage.DESCRIPTOR.fields_by_name["content"].type == FieldDescriptor.TYPE_STRING
