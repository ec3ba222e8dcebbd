"""Qwen3NextForCausalLM, Qwen3_5MoeForCausalLM and Qwen3_5MoeForConditionalGeneration (its text model):
hybrid Gated DeltaNet / gated full-attention layers with a per-sequence recurrent state, softmax top-k
MoE with a gated shared expert."""
from moemesh.models.qwen3_next.config import QWEN3_5_MOE, QWEN3_5_MOE_VL, QWEN3_NEXT, parse_config
from moemesh.models.qwen3_next.model import Qwen3NextForCausalLM
from moemesh.models.architecture import ArchitectureSpec

ARCHITECTURE = tuple(ArchitectureSpec(name, parse_config, Qwen3NextForCausalLM) for name in (QWEN3_NEXT, QWEN3_5_MOE, QWEN3_5_MOE_VL))
