"""Deployment of moemesh: container images (`docker/`), Kubernetes manifests (`k8s/`), the offline
kustomize renderer (`render.py`) and the policy checks CI runs over rendered manifests (`check.py`)."""
