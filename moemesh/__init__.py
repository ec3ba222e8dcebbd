"""moemesh shared core: config, checkpoints, models, the tensor wire codec and the CLI."""

__version__ = "0.1.0"
