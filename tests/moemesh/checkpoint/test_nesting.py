"""A multimodal checkpoint's language model under the causal-LM names; plain checkpoints unchanged."""
from moemesh.checkpoint.nesting import language_model_aliases


def test_published_llava_style_names():
    names = ["language_model.model.layers.0.mlp.gate.weight", "language_model.model.embed_tokens.weight",
             "language_model.lm_head.weight", "vision_tower.encoder.blocks.0.wo.weight", "mm_projector.proj.0.weight"]
    assert language_model_aliases(names) == {
        "model.layers.0.mlp.gate.weight": names[0], "model.embed_tokens.weight": names[1], "lm_head.weight": names[2],
    }


def test_transformers_vl_names_and_kimi_blocks():
    assert language_model_aliases(["model.language_model.layers.3.x", "lm_head.weight", "model.visual.y"]) == {
        "model.layers.3.x": "model.language_model.layers.3.x"}
    assert language_model_aliases(["language_model.model.blocks.2.self_attn.o_proj.weight"]) == {
        "model.layers.2.self_attn.o_proj.weight": "language_model.model.blocks.2.self_attn.o_proj.weight"}


def test_plain_checkpoint_gets_no_aliases():
    assert language_model_aliases(["model.layers.0.x", "model.language_model.layers.0.x", "lm_head.weight"]) == {}
