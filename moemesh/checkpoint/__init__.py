"""Lazy, memory-mapped safetensors checkpoints (single file or sharded) with clear errors."""
from moemesh.checkpoint.errors import CheckpointError
from moemesh.checkpoint.reader import CheckpointReader

__all__ = ["CheckpointError", "CheckpointReader"]
