"""The one error type a checkpoint problem raises."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A model directory cannot be read: missing files, missing or misshapen tensors, corrupt data."""
