"""Services, readiness probes and ports of local-exec pods: the kube-proxy and prober of the test kubelet.

Local-exec pods share this machine's network, so two servers listening on their pod's port would
collide, and a Service's DNS name resolves nowhere here. For the servers rljob runs
(spec.environments[]: a container whose env holds `RLJOB_ENV_PORT`, docs/contracts.md §4), the test
kubelet does what the pod network, kube-proxy and the kubelet's prober do on a cluster:
- each such pod gets a free port of this machine in place of its container port (`RLJOB_ENV_PORT`
  rewritten, `$(RLJOB_ENV_PORT)` in its args with it), fixed per pod name as its DNS name is: two
  replicas or two jobs never collide; so does trainer pod 0's OpenAI-compatible endpoint
  (`RLJOB_ENDPOINT_PORT`, the container port `endpoint`), which the environment pods of mode agent
  reach by the pod's own name;
- a `ServiceProxy` per Service port listens on a free port and forwards each connection to one
  *ready* pod the Service selects (round robin), or refuses it while none is ready, as kube-proxy
  (or a headless Service's DNS) sends traffic to ready endpoints only;
- in a ConfigMap's JSON/YAML mounted by a local pod (trainer.json's environment URLs),
  `http://<service>.<namespace>.svc[.cluster.local][:port]` becomes `http://127.0.0.1:<its proxy's
  port>`, and a pod's own name under a headless Service, `http://<pod>.<service>.<namespace>.svc:port`,
  `http://127.0.0.1:<that pod's port>` (the pod's DNS record: reached whether ready or not, as a
  connection to a pod IP is; the cluster's DNS drops the record of a pod that is not ready);
- an `httpGet` readiness probe runs as the kubelet's prober does (periodSeconds, timeoutSeconds,
  failureThreshold; the first success makes the pod Ready), against the pod's own port.
Nothing here is more permissive than a cluster: a pod not ready gets no traffic, a Service that
selects no ready pod refuses connections.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

ENV_SERVER_PORT = "RLJOB_ENV_PORT"  # rljob_operator.names.ENV_ENVIRONMENT_PORT
ENV_ENDPOINT_PORT = "RLJOB_ENDPOINT_PORT"  # rljob_trainer.config.ENV_ENDPOINT_PORT
#: The variables holding a port a local pod's process binds: each gets this machine's port for it.
PORT_ENVS = (ENV_SERVER_PORT, ENV_ENDPOINT_PORT)
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_SERVICE_URL = re.compile(
    rf"http://(?:(?P<pod>{_LABEL})\.)?(?P<svc>{_LABEL})\.(?P<ns>{_LABEL})\.svc"
    r"(?:\.cluster\.local)?(?::(?P<port>\d+))?"
)

Resolve = Callable[[str, str, str | None, int], int | None]


def rewrite_service_urls(text: str, resolve: Resolve) -> str:
    """`text` with every in-cluster URL `resolve(namespace, service, pod or None, port)` knows replaced
    by `http://127.0.0.1:<local port>` (unknown ones stay as written)."""

    def sub(match: re.Match[str]) -> str:
        port = int(match.group("port") or 80)
        local = resolve(match.group("ns"), match.group("svc"), match.group("pod"), port)
        return match.group(0) if local is None else f"http://127.0.0.1:{local}"

    return _SERVICE_URL.sub(sub, text)


def selects(selector: Mapping[str, str] | None, labels: Mapping[str, str] | None) -> bool:
    """A Service selector (every pair present) against a pod's labels; an empty selector selects none
    (a Service without a selector has its endpoints set by hand, never pods)."""
    return bool(selector) and all((labels or {}).get(k) == v for k, v in (selector or {}).items())


class ServiceProxy:
    """One Service port: a listening socket on 127.0.0.1 forwarding to a ready endpoint's local port."""

    def __init__(self, name: str, endpoints: Callable[[], list[int]]) -> None:
        self.name = name
        self._endpoints = endpoints
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = int(self._listener.getsockname()[1])
        self._next = itertools.count()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"fakelet-svc-{name}", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        ports = self._endpoints()
        if not ports:  # no ready endpoint: refused, as kube-proxy rejects a Service without endpoints
            client.close()
            return
        port = ports[next(self._next) % len(ports)]
        try:
            upstream = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        threading.Thread(target=_pump, args=(upstream, client), daemon=True).start()
        _pump(client, upstream)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            source.close()


def container_port(container: Any, port: int | str) -> int | None:
    """A probe's or a Service's target port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for declared in container.ports or []:
        if declared.name == port:
            return int(declared.container_port)
    return None


def http_probe(port: int, path: str, timeout_s: float) -> bool:
    """The kubelet's httpGet probe: success is a status in 200..399 within the timeout."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as response:
            return 200 <= response.status < 400
    except urllib.error.HTTPError as error:
        return 200 <= error.code < 400
    except (OSError, ValueError):
        return False
