"""Kimi-K2.5 (transformers' Kimi_K25ForConditionalGeneration; the published checkpoints name it
KimiK25ForConditionalGeneration): its language model, a DeepSeek-V3 text model (`text_config`), is
served; image and video input is refused (the vision tower is never loaded)."""
from moemesh.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moemesh.models.kimi_k25.config import ARCHITECTURE_NAMES, parse_config
from moemesh.models.architecture import ArchitectureSpec

ARCHITECTURE = tuple(ArchitectureSpec(name, parse_config, DeepseekV3ForCausalLM) for name in ARCHITECTURE_NAMES)
