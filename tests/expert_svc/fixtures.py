"""Shared by the expert-server, control-plane and RemoteExperts tests: a tiny MoE checkpoint and
expert servers running in a background event loop."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from expert_svc.config import ExpertServerConfig
from expert_svc.server import create_server
from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config
from moemesh.moe.expert_loader import load_expert_weights
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


def routed_rows(num_rows: int, expert_ids: list[int], seed: int = 0):
    """x [N, H] and counts [G] spreading N rows unevenly over expert_ids (some may get 0 rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, HIDDEN, generator=g)
    weights = torch.rand(len(expert_ids), generator=g) + 0.1
    counts = torch.distributions.Multinomial(num_rows, probs=weights / weights.sum()).sample().to(torch.int64)
    return x, torch.tensor(expert_ids, dtype=torch.int64), counts


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
