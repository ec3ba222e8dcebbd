"""`ExpertShard`: the (layer, expert) set one expert server holds, and the grouped GEMM over it.

Shape legend: N rows grouped by expert, G experts named by a request, E experts held for a layer,
H hidden, I expert intermediate.

Each layer's experts live in one `kernels.ExpertWeights` (E = the experts held, ascending), loaded
with `load_expert_weights` from the memory-mapped checkpoint; dense experts are held in the
concatenated layout of `ConcatenatedExperts` too (the same storage), so `forward_weighted` over all
of them is two plain matmuls. `load`/`drop` build the layer's new
weights off to the side and swap in an immutable `LayerShard`, so a forward that started on the old
set finishes on it: a live placement change never disturbs a request in flight. Only the experts a
`load` adds are read from the checkpoint (`experts_read` counts them); the ones held are copied from
memory into the new layer, and a `drop` reads nothing.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from expert_svc.errors import BadForward, OverBudget, UnknownExperts
from expert_svc.stats import ShardStats
from kernels import ExpertWeights, grouped_expert_mlp
from moemesh.checkpoint import CheckpointReader
from moemesh.config import ModelConfig
from moemesh.models.registry import load_model_config
from moemesh.moe.all_experts import ConcatenatedExperts
from moemesh.moe.expert_loader import load_expert_weights


@dataclass(frozen=True)
class LayerShard:
    expert_ids: tuple[int, ...]  # [E] logical ids held, ascending
    weights: ExpertWeights  # E experts in the order of expert_ids, on the shard's device
    concatenated: ConcatenatedExperts | None = None  # the same E experts side by side (dense only)

    def local_index(self, layer: int, expert_ids: list[int]) -> list[int]:
        index = {e: i for i, e in enumerate(self.expert_ids)}
        missing = [e for e in expert_ids if e not in index]
        if missing:
            raise UnknownExperts(f"layer {layer}: experts {missing} are not held by this server (held: {list(self.expert_ids)})")
        return [index[e] for e in expert_ids]


def weights_to(w: ExpertWeights, device: torch.device) -> ExpertWeights:
    """Every tensor field of `w` (dense tensors and kernels.formats quantized experts) moved to `device`."""
    values = {f.name: getattr(w, f.name) for f in dataclasses.fields(w)}
    moved = {name: v.to(device) for name, v in values.items() if v is not None and callable(getattr(v, "to", None))}
    return dataclasses.replace(w, **moved)


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
    ):
        """stats: where forwards are counted (default: a 60 s load window, no Prometheus metrics)."""
        self.reader = reader
        self.model = model
        self.dtype = dtype
        self.device = device
        self.experts_dtype = experts_dtype
        self.slot_budget = slot_budget
        self.stats = stats or ShardStats(model.moe_layers, model.num_experts)
        self._layers: dict[int, LayerShard] = {}
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
                raise OverBudget(
                    f"loading layer {layer} experts {sorted(want - have)} needs {self.slots_used() - len(have) + len(new)} slots, "
                    f"slot_budget is {self.slot_budget}"
                )
            added = sorted(want - have)
            fresh = weights_to(load_expert_weights(self.reader, self.model, layer, added, self.dtype, self.experts_dtype), self.device)
            self.experts_read += len(added)
            if current is None:
                self._install(layer, added, fresh)
            else:  # held experts then added ones, put in id order
                combined = list(current.expert_ids) + added
                order = sorted(range(len(combined)), key=combined.__getitem__)
                merged = ExpertWeights.concat([current.weights, fresh], torch.tensor(order))
                self._install(layer, new, merged)
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
        adopted = ConcatenatedExperts.adopt(w)
        if adopted is None:
            self._layers[layer] = LayerShard(tuple(expert_ids), w)
        else:  # the [E, .., ..] weights re-viewed from the concatenated storage: one copy
            cat, w = adopted
            self._layers[layer] = LayerShard(tuple(expert_ids), w, cat)

    def check_experts(self, layer: int, experts: Iterable[int]) -> set[int]:
        if not (0 <= layer < self.model.num_layers and self.model.is_moe_layer(layer)):
            raise BadForward(f"layer {layer} is not a MoE layer of this model (MoE layers: {list(self.model.moe_layers)})")
        ids = {int(e) for e in experts}
        bad = sorted(e for e in ids if not 0 <= e < self.model.num_experts)
        if bad:
            raise BadForward(f"expert_ids {bad} are outside [0, {self.model.num_experts})")
        return ids

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, layer: int, x: Tensor, expert_ids: list[int], counts: list[int]) -> Tensor:
        """x [N, H] rows grouped by expert in the order of expert_ids [G]; counts [G] sum N.
        Returns [N, H] unweighted expert outputs in x.dtype on x.device."""
        self.validate(layer, x, expert_ids, counts)
        shard = self._layers.get(layer)
        if shard is None:
            raise UnknownExperts(f"layer {layer}: experts {list(expert_ids)} are not held by this server (it holds none of layer {layer})")
        local = shard.local_index(layer, expert_ids)
        start = time.perf_counter()
        if x.shape[0] == 0:
            y = torch.empty_like(x)
        else:
            xin = x.to(self.device, self.dtype)  # [N, H]
            idx = torch.tensor(local, dtype=torch.int64, device=self.device)  # [G]
            cnt = torch.tensor(counts, dtype=torch.int64, device=self.device)  # [G]
            y = grouped_expert_mlp(xin, idx, cnt, shard.weights).to(x.device, x.dtype)  # [N, H]
        self.stats.record(layer, expert_ids, counts, time.perf_counter() - start)
        return y

    def forward_weighted(self, layer: int, x: Tensor, expert_ids: list[int], weights: Tensor) -> Tensor:
        """Combine on the server: x [T, H] (each token once), weights [T, G] float32 combine weights
        for expert_ids [G] -> [T, H] = sum_g weights[:, g] * expert_g(x), in x.dtype on x.device.
        Requests naming every expert held for the layer (the usual case: each expert's tokens go to
        one of its copies) run as two matmuls over the concatenated experts; others through the
        grouped GEMM with every token routed to every named expert."""
        self.validate_weighted(layer, x, expert_ids, weights)
        shard = self._layers.get(layer)
        if shard is None:
            raise UnknownExperts(f"layer {layer}: experts {list(expert_ids)} are not held by this server (it holds none of layer {layer})")
        local = shard.local_index(layer, expert_ids)
        t, g = x.shape[0], len(expert_ids)
        start = time.perf_counter()
        if t == 0:
            y = torch.empty_like(x)
        else:
            xin = x.to(self.device, self.dtype)  # [T, H]
            w = weights.to(self.device, torch.float32)  # [T, G]
            cat = shard.concatenated
            if cat is not None and sorted(local) == list(range(len(shard.expert_ids))):
                if local == list(range(len(local))):
                    full = w  # [T, E]: already in the held order (the usual request)
                else:
                    full = torch.zeros(t, len(shard.expert_ids), dtype=torch.float32, device=self.device)  # [T, E]
                    full[:, torch.tensor(local, device=self.device)] = w
                y = cat.mlp(xin, full)  # [T, H]
            else:
                idx = torch.tensor(local, dtype=torch.int64, device=self.device)  # [G]
                cnt = torch.full((g,), t, dtype=torch.int64, device=self.device)  # [G]
                rows = grouped_expert_mlp(xin.repeat(g, 1), idx, cnt, shard.weights).view(g, t, -1)  # [G, T, H]
                y = (rows.float() * w.t()[:, :, None]).sum(0).to(self.dtype)  # [T, H]
            y = y.to(x.device, x.dtype)
        self.stats.record(layer, expert_ids, [t] * g, time.perf_counter() - start)
        return y

    def validate_weighted(self, layer: int, x: Tensor, expert_ids: list[int], weights: Tensor) -> None:
        if not expert_ids:
            raise BadForward("expert_ids must name at least one expert")
        self._validate_x(x)
        self._validate_unique(expert_ids)
        self.check_experts(layer, expert_ids)
        if weights.dim() != 2 or tuple(weights.shape) != (x.shape[0], len(expert_ids)):
            raise BadForward(f"weights must be [T, G] = [{x.shape[0]}, {len(expert_ids)}] (rows of x, experts named), got {list(weights.shape)}")
        if weights.dtype != torch.float32:
            raise BadForward(f"weights.dtype must be float32, got {weights.dtype}")

    def validate(self, layer: int, x: Tensor, expert_ids: list[int], counts: list[int]) -> None:
        self._validate_x(x)
        if len(expert_ids) != len(counts):
            raise BadForward(f"expert_ids has {len(expert_ids)} entries but counts has {len(counts)}")
        self._validate_unique(expert_ids)
        if any(c < 0 for c in counts):
            raise BadForward(f"counts must be >= 0, got {list(counts)}")
        if sum(counts) != x.shape[0]:
            raise BadForward(f"counts sum to {sum(counts)} but x has {x.shape[0]} rows")
        self.check_experts(layer, expert_ids)

    def _validate_x(self, x: Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.model.hidden_size:
            raise BadForward(f"x must be [N, {self.model.hidden_size}], got {list(x.shape)}")
        if not x.dtype.is_floating_point or x.dtype.itemsize < 2:
            raise BadForward(f"x.dtype must be float32, bfloat16 or float16, got {x.dtype}")

    @staticmethod
    def _validate_unique(expert_ids: list[int]) -> None:
        if len(set(expert_ids)) != len(expert_ids):
            raise BadForward(f"expert_ids must name each expert once, got {list(expert_ids)}")

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        dtype: str,
        device: torch.device,
        experts_dtype: str | None = None,
        slot_budget: int = 0,
        load_window_s: float = 60.0,
    ) -> "ExpertShard":
        """dtype: "auto" (the checkpoint's) or a torch dtype name; load_window_s: the stats' load window."""
        model = load_model_config(model_dir)
        if model.num_experts <= 0:
            raise ValueError(f"model_dir {model_dir!r} holds a dense model: no experts to serve")
        compute = model.dtype if dtype == "auto" else getattr(torch, dtype)
        stats = ShardStats(model.moe_layers, model.num_experts, window_s=load_window_s)
        return cls(CheckpointReader(model_dir), model, compute, device, experts_dtype, slot_budget, stats)
