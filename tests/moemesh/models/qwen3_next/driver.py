"""A minimal continuous-batching driver for the hybrid models, below LLMEngine: paged KV blocks for the
full-attention layers, one recurrent-state slot per sequence (RecurrentStateStore), sequences joining
and leaving between steps, decodes first then prefills in each step's batch."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moemesh.checkpoint import CheckpointReader
from moemesh.models.registry import load_model_config
from moemesh.engine.kv_cache import KVCache
from moemesh.engine.recurrent_state import RecurrentStateStore
from moemesh.models.batch import BatchMeta, SeqSlice
from moemesh.models.registry import get_architecture
from moemesh.contracts.knobs import MoeKnobs
from moemesh.moe.local_experts import LocalExperts

BLOCK = 4


@dataclass
class Seq:
    tokens: list[int]
    slot: int
    blocks: list[int]
    cached: int = 0  # tokens whose KV / state is in the caches
    logprobs: list[float] = field(default_factory=list)  # of each generated token
    prompt_logprobs: list[float | None] | None = None


class Driver:
    def __init__(self, path, dtype: torch.dtype = torch.float32, num_blocks: int = 128, num_slots: int = 3) -> None:
        torch.set_num_threads(1)  # as LLMEngine does by default
        cfg = load_model_config(path)
        reader = CheckpointReader(path)
        self.cfg = cfg
        self.model = get_architecture(cfg.architecture).model_class(cfg, reader, dtype)
        self.experts = LocalExperts.from_checkpoint(reader, cfg, dtype)
        self.kv = KVCache(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, dtype)
        self.store = RecurrentStateStore(self.model.recurrent_state_spec(), num_slots, dtype)
        self.caches = [self.store.layers[i] if i in self.store.layers else self.kv.layers[i] for i in range(cfg.num_layers)]
        self.seqs: dict[str, Seq] = {}

    def add(self, name: str, prompt: list[int]) -> None:
        self.seqs[name] = Seq(list(prompt), self.store.slots.allocate(1)[0], [])

    def remove(self, name: str) -> Seq:
        seq = self.seqs.pop(name)
        self.store.slots.free([seq.slot])
        self.kv.allocator.free(seq.blocks)
        return seq

    def step(self) -> None:
        """One model step over every sequence: a decode for those with cached tokens, a prefill for new
        ones; appends each sequence's greedy token and its logprob."""
        order = sorted(self.seqs, key=lambda n: self.seqs[n].cached == 0)  # decodes first
        slices = []
        for name in order:
            seq = self.seqs[name]
            need = -(-len(seq.tokens) // BLOCK) - len(seq.blocks)
            seq.blocks += self.kv.allocator.allocate(need)
            if seq.cached:
                slices.append(SeqSlice([seq.tokens[-1]], seq.cached, seq.blocks, state_slot=seq.slot))
            else:
                slices.append(SeqSlice(seq.tokens, 0, seq.blocks, all_logits=True, state_slot=seq.slot))
        meta = BatchMeta.build(slices, BLOCK)
        logits = self.model.forward(meta, self.caches, self.experts, MoeKnobs())
        for name, (first, n) in zip(order, meta.logits_rows):
            seq = self.seqs[name]
            lp = torch.log_softmax(logits[first : first + n].double(), dim=-1)  # [n, V]
            if not seq.cached:
                seq.prompt_logprobs = [None] + [float(lp[i - 1, t]) for i, t in enumerate(seq.tokens) if i > 0]
            token = int(lp[-1].argmax())
            seq.logprobs.append(float(lp[-1, token]))
            seq.cached = len(seq.tokens)
            seq.tokens.append(token)
