"""`ServerBudget`: how many experts of each MoE layer one expert server can hold."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerBudget:
    """One expert server as the placement solver sees it.

    `slots` is a per-layer budget: the server holds at most `slots` experts of every MoE layer
    (expert weights of one architecture are the same size in every layer, so a per-layer budget
    times the number of MoE layers is the server's expert memory).
    """

    server_id: str
    slots: int

    def __post_init__(self) -> None:
        if not isinstance(self.server_id, str) or not self.server_id:
            raise ValueError(f"server_id must be a non-empty string, got {self.server_id!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 0:
            raise ValueError(f"slots of server {self.server_id!r} must be an int >= 0, got {self.slots!r}")

    @classmethod
    def from_total(cls, server_id: str, total_slots: int, num_layers: int, num_experts: int) -> "ServerBudget":
        """From an expert server's total budget of (layer, expert) copies (its `--slot-budget`;
        0 = no limit): `total_slots // num_layers` per layer, at most `num_experts`."""
        if isinstance(total_slots, bool) or not isinstance(total_slots, int) or total_slots < 0:
            raise ValueError(f"total_slots of server {server_id!r} must be an int >= 0, got {total_slots!r}")
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers and num_experts must be >= 1, got {num_layers}, {num_experts}")
        per_layer = num_experts if total_slots == 0 else min(total_slots // num_layers, num_experts)
        return cls(server_id, per_layer)
