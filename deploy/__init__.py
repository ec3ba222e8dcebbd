"""Deployment of moemesh: container images (`docker/`), Kubernetes manifests (`k8s/`) and the policy
checks CI runs over the manifests as `kubectl kustomize` renders them (`check.py`)."""
