"""Where an attention replica's experts are computed.

Without a control plane the engine computes them in process (`compute=None`: the engine's own
`LocalExperts`). With one, `RemoteExperts` sends each MoE layer's rows to the expert servers of the
current placement, which it follows from the control plane.
"""
from __future__ import annotations

from attention_svc.config import AttentionConfig


class ExpertBackend:
    """In-process experts: nothing to register, close or follow."""

    compute = None
    on_placement = None  # remote backends call it when a new placement awaits adoption

    def placement_version(self) -> int:
        return 0

    def begin_step(self) -> None:
        """Called by the step loop between engine steps (adopts a staged placement)."""
        return None

    async def register(self, address: str) -> None:
        return None

    async def close(self) -> None:
        return None


async def open_experts(cfg: AttentionConfig) -> ExpertBackend:
    if not cfg.control_addr:
        return ExpertBackend()
    from attention_svc.remote_backend import open_remote_experts

    return await open_remote_experts(cfg)
