"""MiniMaxM2ForCausalLM: q/k RMSNorm over all heads, partial rotary, sigmoid router with a selection
bias, every layer MoE."""
from moemesh.models.minimax_m2.config import parse_config
from moemesh.models.minimax_m2.model import MiniMaxM2ForCausalLM
from moemesh.models.architecture import ArchitectureSpec

ARCHITECTURE = ArchitectureSpec("MiniMaxM2ForCausalLM", parse_config, MiniMaxM2ForCausalLM)
