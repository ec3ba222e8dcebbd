"""Decoder models per architecture; see `registry.py` for how an architecture plugs in."""
