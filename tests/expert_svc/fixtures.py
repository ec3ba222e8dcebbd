"""Shared by the expert-server, control-plane and RemoteExperts tests: a tiny MoE checkpoint and
expert servers running in a background event loop."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from expert_svc.config import ExpertServerConfig
from expert_svc.server import create_server
from kernels.moe_mlp import moe_mlp
from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config
from moemesh.moe.dispatch import make_plan
from moemesh.moe.expert_loader import load_expert_weights
from moemesh.moe.gate import softmax_topk
from moemesh.transport.base import ExpertRequest
from tests.fixtures.loop_thread import LoopThread
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.auth import TEST_RPC

NUM_EXPERTS = 8
HIDDEN = 64


def tiny_moe_dir(root: Path) -> Path:
    """A 2-layer Mixtral with 8 experts (hidden 64), float32, saved once under `root`."""
    out = root / "tiny-mixtral"
    if not (out / "config.json").is_file():
        make_tiny_checkpoint("mixtral", out, dtype=torch.float32, seed=1)
    return out


def all_weights(model_dir: Path):
    """layer -> ExpertWeights with every expert, straight from the checkpoint (the oracle)."""
    cfg = load_model_config(model_dir)
    reader = CheckpointReader(model_dir)
    return cfg, {l: load_expert_weights(reader, cfg, l, range(cfg.num_experts), cfg.dtype) for l in cfg.moe_layers}


def routed_request(num_tokens: int, expert_ids: list[int], layer: int = 0, seed: int = 0, top_k: int = 2,
                   dtype: torch.dtype = torch.float32) -> ExpertRequest:
    """One server's part of a layer call: x [T, H], each token routed to min(top_k, G) of expert_ids
    at random with a random weight, rows grouped by expert in the order of expert_ids (an expert may
    get none)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    k = min(top_k, len(expert_ids))
    picks = torch.rand(num_tokens, len(expert_ids), generator=g).argsort(1)[:, :k]  # [T, k] positions in expert_ids
    rows = [torch.nonzero((picks == j).any(1)).flatten() for j in range(len(expert_ids))]
    token_idx = torch.cat(rows).to(torch.int32) if rows else torch.empty(0, dtype=torch.int32)
    counts = torch.tensor([r.numel() for r in rows], dtype=torch.int64)
    weights = torch.rand(token_idx.numel(), generator=g)
    return ExpertRequest(layer, 1, x, token_idx, weights, torch.tensor(expert_ids, dtype=torch.int64), counts)


def expected(req: ExpertRequest, w) -> torch.Tensor:
    """The oracle for a request: moe_mlp over every expert of the layer (logical ids index them), on
    the torch path: servers hold float32 experts [in, out] (matmul_layout), which the compiled CPU
    kernels do not read, so they run that path too."""
    return moe_mlp(req.x, req.token_idx.long(), req.weights, req.expert_ids, req.counts, w, backend="torch")


def routed_plan(num_tokens: int, num_experts: int = NUM_EXPERTS, top_k: int = 2, seed: int = 0):
    """x [T, H] and a dispatch plan routing each token to top_k experts (softmax gate, random logits)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    plan = make_plan(softmax_topk(torch.randn(num_tokens, num_experts, generator=g), top_k, True), num_experts)
    return x, plan


def plan_expected(x: torch.Tensor, plan, w) -> torch.Tensor:
    """The oracle for a layer call (see `expected`)."""
    return moe_mlp(x, plan.token_idx, plan.weights, plan.expert_ids, plan.counts, w, backend="torch")


async def in_loop(fn, *args):
    return fn(*args)


@contextmanager
def running_expert_servers(model_dir: Path, n: int, loop: LoopThread, **overrides):
    """`n` started expert servers on 127.0.0.1 port 0 (in `loop`); yields them (`ExpertServer`)."""
    parts = []
    try:
        for _ in range(n):
            cfg = ExpertServerConfig(model_dir=str(model_dir), **{"rpc": TEST_RPC, **overrides})
            p, _ = loop.run(create_server(cfg), 60)  # an aio server belongs to the loop it is built in
            parts.append(p)
            loop.run(p.start(), 30)
        yield parts
    finally:
        for p in parts:
            loop.run(p.shutdown(0.5), 30)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """Import into a conftest or test module to use: the tiny MoE checkpoint directory."""
    return tiny_moe_dir(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def loop():
    """A background event loop for servers and aio clients, closed after the test."""
    lt = LoopThread("test-loop")
    yield lt
    lt.close()
