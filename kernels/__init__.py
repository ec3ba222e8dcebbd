"""Expert weight formats and grouped expert GEMMs: pure tensor functions, no I/O, no gRPC."""
from kernels.experts import ExpertWeights, grouped_expert_mlp

__all__ = ["ExpertWeights", "grouped_expert_mlp"]
