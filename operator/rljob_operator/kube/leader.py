"""Leader election on a `coordination.k8s.io/v1` Lease, so that of N operator replicas one reconciles.

Called by `rljob operator` (`commands.cmd_operator`) around `handlers.run_operator`: a replica first
waits to hold the Lease `rljob-operator` (names.LEADER_LEASE), then runs kopf's handlers while a
thread renews the Lease. The semantics are client-go's `leaderelection` (what kube-scheduler and
every controller-runtime manager use):

- A candidate takes the Lease when nobody holds it, when it is its own, or when the record has not
  changed for `leaseDurationSeconds` as timed by the candidate's own monotonic clock since it first
  saw that record. It never compares `renewTime` with its own wall clock: clocks differ.
- Every write is a create or a replace carrying the resourceVersion that was read, so two
  candidates never both win one round (the apiserver answers the loser 409).
- The holder renews every `retry_period_s`. When no renewal has succeeded for `renew_deadline_s`,
  or the Lease names someone else, the holder has lost it and the process exits at once
  (`os._exit`, like controller-runtime's "leader election lost"), so its handlers stop. The
  deadline is measured from the start of the last successful renewal, which precedes the moment
  any other candidate could have seen it, and `renew_deadline_s < lease_duration_s`: the old holder
  is gone before a new one may take over. The Deployment restarts the exited container.
- On a clean stop (SIGTERM, after kopf has finished) the holder releases the Lease (empty holder,
  duration 1 s), so a standby takes over within one retry period instead of a whole lease.

A standby replica serves the liveness endpoint itself while it waits (kopf, which serves it on the
leader, is not running yet): 200 while its Lease reads succeed, 503 when they have failed for a
whole lease duration.

The decisions (`may_acquire`, `acquired_record`, `released_record`) are pure and unit-tested; the
`LeaderElector` and `run_as_leader` shell around them is tested against the real apiserver.
"""

from __future__ import annotations

import datetime
import http.server
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import kubernetes

from rljob_operator import names
from rljob_operator.kube import kubeclient

logger = logging.getLogger("rljob.leader")

DEFAULT_NAMESPACE = "default"
# The exit status of a replica that lost the Lease (the Deployment restarts it as a standby).
EXIT_LEASE_LOST = 3


@dataclass(frozen=True)
class ElectionTiming:
    """client-go's defaults (kube-scheduler, controller-runtime): 15 s lease, 10 s deadline, 2 s retry."""

    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election timing needs 0 < retry_period_s < renew_deadline_s < lease_duration_s, "
                f"got {self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )


@dataclass(frozen=True)
class LeaseRecord:
    """The election record a Lease spec holds (holder "" means released)."""

    holder: str
    lease_duration_s: int
    acquire_time: datetime.datetime | None
    renew_time: datetime.datetime | None
    transitions: int


def lease_namespace(flag: str | None, in_cluster_namespace: str | None) -> str:
    """`--leader-election-namespace` when given, else the pod's namespace, else `default` (by hand)."""
    return flag or in_cluster_namespace or DEFAULT_NAMESPACE


def new_identity(hostname: str, suffix: str) -> str:
    """`<hostname>_<suffix>`, as client-go names candidates: the pod name in a cluster, plus a
    per-process suffix so two processes on one machine never share an identity."""
    return f"{hostname}_{suffix}"


def may_acquire(record: LeaseRecord | None, identity: str, *, unchanged_for_s: float) -> bool:
    """Whether `identity` may write itself into the Lease now.

    `record` is what was read (None: no Lease yet); `unchanged_for_s` is how long, by the reader's
    monotonic clock, the record has been exactly this one."""
    if record is None or not record.holder or record.holder == identity:
        return True
    return unchanged_for_s >= record.lease_duration_s


def acquired_record(
    record: LeaseRecord | None, identity: str, now: datetime.datetime, lease_duration_s: int
) -> LeaseRecord:
    """The record `identity` writes to take or renew the Lease at wall time `now`."""
    if record is not None and record.holder == identity:
        return replace(record, renew_time=now, lease_duration_s=lease_duration_s)
    transitions = 0 if record is None else record.transitions + 1
    return LeaseRecord(identity, lease_duration_s, now, now, transitions)


def released_record(record: LeaseRecord, now: datetime.datetime) -> LeaseRecord:
    """What a holder writes when it stops cleanly (client-go's ReleaseOnCancel)."""
    return replace(record, holder="", lease_duration_s=1, renew_time=now)


def _record_from(lease: kubernetes.client.V1Lease) -> LeaseRecord:
    spec = lease.spec or kubernetes.client.V1LeaseSpec()
    return LeaseRecord(
        holder=spec.holder_identity or "",
        lease_duration_s=int(spec.lease_duration_seconds or 0),
        acquire_time=spec.acquire_time,
        renew_time=spec.renew_time,
        transitions=int(spec.lease_transitions or 0),
    )


def _spec_from(record: LeaseRecord) -> kubernetes.client.V1LeaseSpec:
    return kubernetes.client.V1LeaseSpec(
        holder_identity=record.holder,
        lease_duration_seconds=record.lease_duration_s,
        acquire_time=record.acquire_time,
        renew_time=record.renew_time,
        lease_transitions=record.transitions,
    )


class LeaderElector:
    """One candidate for the Lease `namespace/name`: acquire, renew, release.

    Every API call carries a request timeout below the renew deadline, so a hung connection can
    never keep a lost leader running."""

    def __init__(
        self,
        api: kubernetes.client.CoordinationV1Api,
        namespace: str,
        identity: str,
        *,
        name: str = names.LEADER_LEASE,
        timing: ElectionTiming | None = None,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timing = timing or ElectionTiming()
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._lease: kubernetes.client.V1Lease | None = None
        # Monotonic time of the last successful read or write of the Lease (standby liveness).
        self.last_contact = time.monotonic()
        # Monotonic time at which the last successful acquire/renew round began: a holder counts its
        # renew deadline from there, a moment before anyone else could have seen that write.
        self.renewed_at = 0.0
        # While renewing: no request may outlast this moment (None while acquiring).
        self._deadline_at: float | None = None

    @property
    def lease_key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _timeout(self) -> float:
        if self._deadline_at is None:
            return self.timing.retry_period_s
        return max(0.05, min(self.timing.retry_period_s, self._deadline_at - time.monotonic()))

    def try_acquire_or_renew(self) -> bool:
        """One round: read the Lease and write ourselves into it if the rules allow. True: we hold it."""
        started = time.monotonic()
        if self._round():
            self.renewed_at = started
            return True
        return False

    def _round(self) -> bool:
        try:
            lease = self.api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout()
            )
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                logger.warning(f"reading Lease {self.lease_key} failed: {exc.status} {exc.reason}")
                return False
            return self._create(acquired_record(None, self.identity, _now(), self.timing.lease_duration_s))
        except Exception as exc:  # connection refused, timeout: retried next period
            logger.warning(f"reading Lease {self.lease_key} failed: {exc}")
            return False
        self.last_contact = time.monotonic()
        record = _record_from(lease)
        if record != self._observed:
            if self._observed is not None and record.holder != self._observed.holder:
                logger.info(f"Lease {self.lease_key} is now held by {record.holder or 'nobody'}")
            self._observed, self._observed_at = record, time.monotonic()
        if not may_acquire(record, self.identity, unchanged_for_s=time.monotonic() - self._observed_at):
            return False
        lease.spec = _spec_from(acquired_record(record, self.identity, _now(), self.timing.lease_duration_s))
        return self._replace(lease)

    def _create(self, record: LeaseRecord) -> bool:
        body = kubernetes.client.V1Lease(
            metadata=kubernetes.client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=_spec_from(record),
        )
        try:
            self._lease = self.api.create_namespaced_lease(
                self.namespace, body, _request_timeout=self._timeout()
            )
        except Exception as exc:  # 409: another candidate created it first
            logger.info(f"creating Lease {self.lease_key} failed: {_describe(exc)}")
            return False
        self._observed, self._observed_at = record, time.monotonic()
        self.last_contact = time.monotonic()
        return True

    def _replace(self, lease: kubernetes.client.V1Lease) -> bool:
        try:
            # metadata.resourceVersion is the one read: a concurrent writer makes this a 409.
            self._lease = self.api.replace_namespaced_lease(
                self.name, self.namespace, lease, _request_timeout=self._timeout()
            )
        except Exception as exc:
            logger.info(f"writing Lease {self.lease_key} failed: {_describe(exc)}")
            return False
        record = _record_from(self._lease)
        self._observed, self._observed_at = record, time.monotonic()
        self.last_contact = time.monotonic()
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this candidate holds the Lease (True) or `stop` is set (False)."""
        stop = stop or threading.Event()
        logger.info(f"waiting to hold Lease {self.lease_key} as {self.identity}")
        while not stop.is_set():
            if self.try_acquire_or_renew():
                logger.info(f"holding Lease {self.lease_key} as {self.identity}: this replica reconciles")
                return True
            stop.wait(self.timing.retry_period_s)
        return False

    def renew_until(self, stop: threading.Event, on_lost: Callable[[str], None]) -> None:
        """Renew every retry period until `stop` is set; call `on_lost(why)` once the Lease is lost:
        taken by another candidate, or not renewed for `renew_deadline_s` (every request is cut
        short at that deadline, so the loss is noticed on time even when the apiserver hangs)."""
        try:
            self._renew_until(stop, on_lost)
        finally:
            self._deadline_at = None

    def _renew_until(self, stop: threading.Event, on_lost: Callable[[str], None]) -> None:
        while True:
            self._deadline_at = self.renewed_at + self.timing.renew_deadline_s
            remaining = self._deadline_at - time.monotonic()
            if remaining <= 0:
                on_lost(f"Lease {self.lease_key} not renewed for {self.timing.renew_deadline_s:g} s")
                return
            if stop.wait(min(self.timing.retry_period_s, remaining)):
                return
            if time.monotonic() >= self._deadline_at:
                continue  # reported at the top of the loop
            if self.try_acquire_or_renew():
                continue
            if self._observed is not None and self._observed.holder not in ("", self.identity):
                on_lost(f"Lease {self.lease_key} is held by {self._observed.holder}")
                return

    def release(self) -> None:
        """Hand the Lease back if we still hold it, so a standby need not wait a lease duration."""
        if self._lease is None or self._observed is None or self._observed.holder != self.identity:
            return
        self._lease.spec = _spec_from(released_record(self._observed, _now()))
        if self._replace(self._lease):
            logger.info(f"released Lease {self.lease_key}")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _describe(exc: Exception) -> str:
    if isinstance(exc, kubernetes.client.ApiException):
        return f"{exc.status} {exc.reason}"
    return str(exc)


class _StandbyHealth(http.server.BaseHTTPRequestHandler):
    elector: LeaderElector
    path_expected = "/healthz"

    def do_GET(self) -> None:
        healthy = time.monotonic() - self.elector.last_contact < self.elector.timing.lease_duration_s
        status = 200 if self.path.split("?")[0] == self.path_expected and healthy else 503
        body = b'{"role": "standby"}' if status == 200 else b'{"role": "standby", "lease": "unreachable"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@contextmanager
def standby_health(endpoint: str | None, elector: LeaderElector) -> Iterator[None]:
    """Serve `endpoint` (e.g. http://0.0.0.0:8080/healthz) while waiting for the Lease; kopf serves it
    once this replica leads, so the socket is closed before kopf binds it."""
    if not endpoint:
        yield
        return
    url = urllib.parse.urlsplit(endpoint)
    handler = type("StandbyHealth", (_StandbyHealth,), {"elector": elector, "path_expected": url.path or "/"})
    http.server.ThreadingHTTPServer.allow_reuse_address = True
    server = http.server.ThreadingHTTPServer((url.hostname or "0.0.0.0", url.port or 80), handler)
    thread = threading.Thread(target=server.serve_forever, name="rljob-standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _exit_lost(why: str) -> None:
    """Stop reconciling now: kill the whole process (kopf's handlers with it) before anyone else leads."""
    logger.error(f"leader election lost ({why}): exiting so that no two replicas reconcile at once")
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


def run_as_leader(
    run: Callable[[], None],
    *,
    namespace: str,
    health_endpoint: str | None = None,
    timing: ElectionTiming | None = None,
    identity: str | None = None,
) -> int:
    """Wait for the Lease, then `run()` (the operator) while renewing it; release it when `run` returns."""
    # Until kopf configures logging (in `run`), the election logs through a handler of its own.
    standby_log = logging.StreamHandler()
    standby_log.setFormatter(logging.Formatter("[%(asctime)s] %(name)-20s [%(levelname)-8s] %(message)s"))
    logging.getLogger().addHandler(standby_log)
    logger.setLevel(logging.INFO)
    configuration = kubeclient.load_configuration()
    api_client = kubernetes.client.ApiClient(configuration)
    elector = LeaderElector(
        kubernetes.client.CoordinationV1Api(api_client),
        namespace,
        identity or new_identity(socket.gethostname(), uuid.uuid4().hex[:8]),
        timing=timing,
    )
    with standby_health(health_endpoint, elector):
        elector.acquire()
    logging.getLogger().removeHandler(standby_log)
    stop = threading.Event()
    renewer = threading.Thread(
        target=elector.renew_until, args=(stop, _exit_lost), name="rljob-lease-renewer", daemon=True
    )
    renewer.start()
    try:
        run()
    finally:
        stop.set()
        renewer.join(timeout=timing.retry_period_s * 2 if timing else 5)
        elector.release()
        api_client.close()
    return 0
