"""The expert server's checks of an incoming `ExpertRequest` (gRPC stream and dist frames alike): the
one place a request is validated. Each failure is INVALID_ARGUMENT with a message that starts with
the offending field; which experts the server holds is the shard's check (FAILED_PRECONDITION).

Shape legend: T tokens sent, N rows, G experts named, H hidden, E experts of the model.
"""
from __future__ import annotations

import torch

from moemesh.config import ModelConfig
from moemesh.errors import invalid
from moemesh.transport.base import ExpertRequest

X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_request(req: ExpertRequest, model: ModelConfig) -> tuple[list[int], list[int]]:
    """Raises MeshError(INVALID_ARGUMENT) unless `req` is a well-formed call for one MoE layer of
    `model`; returns its expert ids and counts as lists (the checks read them so; the caller reuses them)."""
    check_layer(req.layer, model)
    x, h = req.x, model.hidden_size
    if x.dim() != 2 or x.shape[1] != h:
        raise invalid(f"x: must be [T, {h}], got {list(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise invalid(f"x.dtype: must be float32, bfloat16 or float16, got {x.dtype}")
    ids, counts = req.expert_ids, req.counts
    if ids.dim() != 1 or ids.dtype != torch.int64 or not ids.numel():
        raise invalid(f"expert_ids: must name at least one expert (int64 [G]), got {ids.dtype} {list(ids.shape)}")
    if counts.dtype != torch.int64 or counts.shape != ids.shape:
        raise invalid(f"counts: must be int64 [G] = [{ids.numel()}] like expert_ids, got {counts.dtype} {list(counts.shape)}")
    id_list, count_list = ids.tolist(), counts.tolist()  # G is small: Python over the values, no tensor ops
    check_experts(id_list, model)
    n = req.token_idx.numel()
    if min(count_list) < 0 or sum(count_list) != n:
        raise invalid(f"counts: must be >= 0 and sum to the {n} rows of token_idx, got {count_list}")
    if req.token_idx.dtype != torch.int32 or req.token_idx.dim() != 1:
        raise invalid(f"token_idx: must be int32 [N], got {req.token_idx.dtype} {list(req.token_idx.shape)}")
    if n:
        lo, hi = torch.aminmax(req.token_idx)
        if int(lo) < 0 or int(hi) >= x.shape[0]:
            raise invalid(f"token_idx: every value must index a row of x, in [0, {x.shape[0]})")
    if req.weights.dtype != torch.float32 or tuple(req.weights.shape) != (n,):
        raise invalid(f"weights: must be float32 [N] = [{n}], got {req.weights.dtype} {list(req.weights.shape)}")
    return id_list, count_list


def check_layer(layer: int, model: ModelConfig) -> None:
    if not (0 <= layer < model.num_layers and model.is_moe_layer(layer)):
        raise invalid(f"layer: {layer} is not a MoE layer of this model (MoE layers: {list(model.moe_layers)})")


def check_experts(expert_ids: list[int], model: ModelConfig) -> None:
    """Each id once, each in [0, E)."""
    if len(set(expert_ids)) != len(expert_ids):
        raise invalid(f"expert_ids: must name each expert once, got {expert_ids}")
    bad = sorted(e for e in expert_ids if not 0 <= e < model.num_experts)
    if bad:
        raise invalid(f"expert_ids: {bad} are outside [0, {model.num_experts})")
