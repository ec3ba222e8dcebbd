"""`ExpertShard`: the (layer, expert) set one expert server holds, and the calls computed over it.

Shape legend: T tokens sent, N rows grouped by expert, G experts named by a request, E experts held
for a layer, H hidden.

Each layer's experts live in one `LayerExperts` (E = the experts held, ascending), loaded with
`load_expert_weights` from the memory-mapped checkpoint. A call is this server's part of one MoE
layer (`ExpertRequest`): the shard checks it (`check_request`, then the experts it holds), runs it
and returns its weighted partial sum. `load`/`drop` build the layer's new weights off to the side
and swap in a new immutable `LayerExperts`, so a call that started on the old set finishes on it: a
live placement change never disturbs a request in flight. Only the experts a `load` adds are read
from the checkpoint (`experts_read` counts them); the ones held are copied from memory into the new
layer, and a `drop` reads nothing.
"""
from __future__ import annotations

import threading
import time
from typing import Iterable

import grpc
import torch
from torch import Tensor

from expert_svc.request_check import check_experts, check_layer, check_request
from expert_svc.stats import ShardStats
from kernels import ExpertWeights
from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.errors import MeshError
from moemesh.models.registry import load_model_config
from moemesh.moe.expert_loader import load_expert_weights
from moemesh.moe.layer_experts import LayerExperts, all_experts_path_by_default, pack_by_default
from moemesh.transport.base import ExpertRequest


class ExpertShard:
    def __init__(
        self,
        reader: CheckpointReader,
        model: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        experts_dtype: str | None = None,
        slot_budget: int = 0,
        stats: ShardStats | None = None,
        pack: bool | None = None,
        all_experts_path: bool = True,
    ):
        """stats: where calls are counted (default: a 60 s load window, no Prometheus metrics).
        pack: hold a oneDNN-packed copy of dense experts for calls that send every token to every
        expert held (None = auto, `pack_by_default`: only for a model whose own top-k is its number
        of experts). all_experts_path: False runs every call through `kernels.moe_mlp`; True holds the
        all-experts layout where it applies (`all_experts_path_by_default`: the model's own top-k is
        its number of experts)."""
        self.reader = reader
        self.model = model
        self.dtype = dtype
        self.device = device
        self.experts_dtype = experts_dtype
        self.slot_budget = slot_budget
        self.stats = stats or ShardStats(model.moe_layers, model.num_experts)
        self.all_experts_path = all_experts_path and all_experts_path_by_default(model.top_k, model.num_experts)
        if pack is None:  # at most every expert of every MoE layer, dense in the compute dtype
            most = len(model.moe_layers) * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size
            pack = pack_by_default(model.top_k, model.num_experts, dtype, device, most * dtype.itemsize)
        self.pack = pack
        self._layers: dict[int, LayerExperts] = {}
        self._mutate = threading.Lock()  # one load/drop at a time; forwards never take it
        self.experts_read = 0  # (layer, expert) weights read from the checkpoint since start

    # ---- placement changes -------------------------------------------------------------------
    def held(self) -> dict[int, tuple[int, ...]]:
        return {layer: s.expert_ids for layer, s in sorted(self._layers.items())}

    def slots_used(self) -> int:
        return sum(len(s.expert_ids) for s in self._layers.values())

    def load(self, layer: int, experts: Iterable[int]) -> tuple[int, ...]:
        """Hold `experts` of `layer` as well (already held ones are kept). Returns the layer's set."""
        want = self.check_experts(layer, experts)
        with self._mutate:
            current = self._layers.get(layer)
            have = set(current.expert_ids) if current else set()
            new = sorted(have | want)
            if len(new) == len(have):
                return tuple(new)
            if self.slot_budget and self.slots_used() - len(have) + len(new) > self.slot_budget:
                raise MeshError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"slot_budget: loading layer {layer} experts {sorted(want - have)} needs {self.slots_used() - len(have) + len(new)} slots, "
                    f"slot_budget is {self.slot_budget}"
                )
            added = sorted(want - have)
            fresh = load_expert_weights(self.reader, self.model, layer, added, self.dtype, self.experts_dtype).to(self.device)
            self.experts_read += len(added)
            if current is None:
                self._install(layer, added, fresh)
            else:  # held experts then added ones, put in id order
                combined = list(current.expert_ids) + added
                order = sorted(range(len(combined)), key=combined.__getitem__)
                self._install(layer, new, ExpertWeights.concat([current.weights, fresh], torch.tensor(order)))
            return tuple(new)

    def drop(self, layer: int, experts: Iterable[int]) -> tuple[int, ...]:
        """Stop holding `experts` of `layer` (ones not held are ignored). Returns the layer's set."""
        gone = self.check_experts(layer, experts)
        with self._mutate:
            current = self._layers.get(layer)
            if current is None:
                return ()
            keep = [e for e in current.expert_ids if e not in gone]
            if len(keep) == len(current.expert_ids):
                return current.expert_ids
            if keep:
                at = [i for i, e in enumerate(current.expert_ids) if e not in gone]
                self._install(layer, keep, current.weights.select(torch.tensor(at)))
            else:
                del self._layers[layer]
            return tuple(keep)

    def load_all(self) -> None:
        for layer in self.model.moe_layers:
            self.load(layer, range(self.model.num_experts))

    def _install(self, layer: int, expert_ids: list[int], w: ExpertWeights) -> None:
        """Serve `w` (experts `expert_ids`, ascending, on the shard's device) for `layer` from now on."""
        held = LayerExperts.hold(expert_ids, w, self.all_experts_path)
        self._layers[layer] = held.packed() if self.pack else held

    def check_experts(self, layer: int, experts: Iterable[int]) -> set[int]:
        """The ids of a load or drop, checked (MeshError INVALID_ARGUMENT naming the field)."""
        check_layer(layer, self.model)
        ids = sorted({int(e) for e in experts})
        check_experts(ids, self.model)
        return set(ids)

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, req: ExpertRequest) -> Tensor:
        """This server's part of one MoE layer call -> y [T, H] in req.x.dtype on req.x.device, the
        weighted partial sum over the rows. Raises MeshError: INVALID_ARGUMENT for a malformed
        request, FAILED_PRECONDITION for experts this server does not hold."""
        cpu_start = time.thread_time()  # this thread's CPU: the call's handling outside the kernel is reported apart
        ids, counts = check_request(req, self.model)
        layer = req.layer
        experts = self._layers.get(layer)
        if experts is None:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"layer {layer}: experts {ids} are not held by this server (it holds none of layer {layer})")
        missing = [e for e in ids if e not in experts.index]
        if missing:
            raise MeshError(grpc.StatusCode.FAILED_PRECONDITION, f"layer {layer}: experts {missing} are not held by this server (held: {list(experts.expert_ids)})")
        start, cpu_in = time.perf_counter(), time.thread_time()
        local = torch.tensor([experts.index[e] for e in ids], dtype=torch.int64, device=self.device)  # [G]
        y = experts(
            req.x.to(self.device, self.dtype),  # [T, H]
            req.token_idx.to(self.device, torch.int64),  # [N]
            req.weights.to(self.device),  # [N]
            local,
            req.counts.to(self.device),  # [G]
        )
        seconds, cpu_out = time.perf_counter() - start, time.thread_time()
        self.stats.record(layer, req.expert_ids, req.counts, seconds, counts, compute_cpu=cpu_out - cpu_in,
                          call_cpu=cpu_in - cpu_start)
        return y.to(req.x.device, req.x.dtype)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        dtype: str,
        device: torch.device,
        experts_dtype: str | None = None,
        slot_budget: int = 0,
        load_window_s: float = 60.0,
        pack: bool | None = None,
        all_experts_path: bool = True,
    ) -> "ExpertShard":
        """dtype: "auto" (the checkpoint's) or a torch dtype name; load_window_s: the stats' load window;
        pack, all_experts_path: see the constructor."""
        model = load_model_config(model_dir)
        if model.num_experts <= 0:
            raise ValueError(f"model_dir {model_dir!r} holds a dense model: no experts to serve")
        compute = model.dtype if dtype == "auto" else getattr(torch, dtype)
        stats = ShardStats(model.moe_layers, model.num_experts, window_s=load_window_s)
        return cls(CheckpointReader(model_dir), model, compute, device, experts_dtype, slot_budget, stats, pack, all_experts_path)
