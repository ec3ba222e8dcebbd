"""Expert weight formats and the routed expert MLP over them: pure tensor functions, no I/O, no gRPC.

Modules import one way: formats <- experts <- {grouped_torch, cpu, triton} <- grouped <- moe_mlp."""
from kernels.experts import ExpertWeights
from kernels.grouped import grouped_expert_mlp
from kernels.moe_mlp import moe_mlp
from kernels.prepare import EXPERT_DTYPES, prepare_experts

__all__ = ["ExpertWeights", "grouped_expert_mlp", "moe_mlp", "prepare_experts", "EXPERT_DTYPES"]
