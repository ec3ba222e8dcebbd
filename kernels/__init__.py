"""Expert weight formats and grouped expert GEMMs: pure tensor functions, no I/O, no gRPC."""
from kernels.dequantized_cache import DequantizedWeights
from kernels.experts import ExpertWeights, grouped_expert_mlp
from kernels.prepare import EXPERT_DTYPES, prepare_experts

__all__ = ["DequantizedWeights", "ExpertWeights", "grouped_expert_mlp", "prepare_experts", "EXPERT_DTYPES"]
