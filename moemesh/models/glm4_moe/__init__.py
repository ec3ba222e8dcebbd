"""Glm4MoeForCausalLM (GLM-4.5 MoE): partial rotary, optional q/k norm, grouped sigmoid gate, shared experts."""
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.glm4_moe.config import parse_config
from moemesh.models.glm4_moe.model import Glm4MoeForCausalLM

ARCHITECTURE = ArchitectureSpec("Glm4MoeForCausalLM", parse_config, Glm4MoeForCausalLM)
