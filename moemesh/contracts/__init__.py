"""The contracts the mesh's services share (every service imports them from here, never from another
service):

- `placement.py`: `Placement`, the versioned map (layer, logical expert) -> expert servers;
- `info.py`: `ServerInfo` (an expert server as the control plane and attention replicas know it),
  `ModelInfo` (the served model's limits, from an attention replica to the router) and
  `LoadReport` (an attention replica's load, polled by the router);
- `knobs.py`: `MoeKnobs`, top-k and capacity factor per MoE layer, from the control plane to the engine;
- `wire.py`: their moemesh.v1 proto translations.
"""
