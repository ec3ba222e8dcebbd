"""What the services tell each other about themselves: expert servers (`ServerInfo`), the served
model (`ModelInfo`) and an attention replica's load (`LoadReport`)."""
from __future__ import annotations

from dataclasses import dataclass

SERVER_STATES = ("serving", "draining", "dead")


@dataclass(frozen=True)
class ServerInfo:
    """An expert server as the control plane and attention replicas know it."""

    server_id: str
    address: str
    device: str = "cpu"
    memory_bytes: int = 0
    slot_budget: int = 0  # 0 = no limit
    host_id: str = ""
    dist_addr: str = ""  # empty: no torch.distributed transport offered
    state: str = "serving"  # one of SERVER_STATES


@dataclass(frozen=True)
class ModelInfo:
    """The served model's limits: an attention replica reports them (with its model directory and
    placement version); the router validates requests against them and adds what it knows itself
    (the name clients may ask for, whether its tokenizer has a chat template)."""

    architecture: str
    vocab_size: int
    max_context: int
    max_new_tokens_limit: int
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    num_layers: int = 0
    model_dir: str = ""  # the replica's model directory (resolved)
    placement_version: int = 0  # the expert placement the replica runs
    name: str = ""  # the name clients may pass as `model` (the router's)
    has_chat_template: bool = False  # the router's tokenizer has one
    kv_block_size: int = 0  # tokens per KV block (prefix-aware routing hashes whole blocks)
    prefix_caching: bool = False  # the replica reuses cached blocks of earlier prompts


@dataclass(frozen=True)
class LoadReport:
    """An attention replica's load, polled by the routers."""

    waiting: int = 0  # sequences queued for their first step
    running: int = 0  # sequences holding KV blocks
    free_blocks: int = 0
    total_blocks: int = 0
    serving: bool = True  # False once draining
    accepted: int = 0  # sequences accepted since the replica started

    @property
    def sequences(self) -> int:
        return self.waiting + self.running
