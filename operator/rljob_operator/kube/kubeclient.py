"""Where the operator's Kubernetes credentials come from, read at call time.

Called by `rljob_operator.kube.leader` (the Lease elector) before kopf starts, and by
`adapter.Kube.from_environment` (the operator's API adapter). The rule: `$KUBECONFIG` (its first
path) or `~/.kube/config` when that file exists, else the in-cluster ServiceAccount. The
kubernetes package reads `$KUBECONFIG` at import time; reading it here, when asked, lets tests and
`rljob operator` set it first.
"""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes

# Where the kubelet mounts a pod's ServiceAccount; `namespace` names the pod's own namespace.
SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def kubeconfig_path() -> Path:
    return Path((os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")).split(os.pathsep)[0])


def load_configuration() -> kubernetes.client.Configuration:
    """A client configuration from the kubeconfig when there is one, else from the pod's ServiceAccount."""
    configuration = kubernetes.client.Configuration()
    path = kubeconfig_path()
    if path.exists():
        kubernetes.config.load_kube_config(config_file=str(path), client_configuration=configuration)
    else:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    return configuration


def in_cluster_namespace() -> str | None:
    """The namespace of the pod this process runs in, or None outside a cluster."""
    try:
        return (SERVICEACCOUNT_DIR / "namespace").read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
