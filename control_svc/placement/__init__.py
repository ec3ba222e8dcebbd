"""Expert placement: the versioned map of (layer, logical expert) -> expert servers, and its solver."""
from control_svc.placement.types import Placement

__all__ = ["Placement"]
