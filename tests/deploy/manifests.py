"""The kustomizations CI renders, and a cached `kubectl kustomize` render of each."""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

from deploy.check import render

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("base", "overlays/gpu", "overlays/cpu-dev")


@lru_cache(maxsize=None)
def _rendered(name: str) -> tuple:
    return tuple(render(K8S / name))


def rendered(name: str) -> list[dict]:
    """A fresh deep copy of the rendered objects (tests may mutate it)."""
    return copy.deepcopy(list(_rendered(name)))


def find(objs: list[dict], kind: str, name: str) -> dict:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)
