"""Where create -> all pods goes: `bench/operator_scale.py`'s latency breakdown, from the operator's
trace (`RLJOB_TRACE_FILE`, `rljob_operator.kube.trace`) and the bench's own watch, and the operator's
API pool and the apiserver's own time for the writes (docs/operator-latency.md)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# ---- where create -> all pods goes (the operator's trace + the bench's watch) ----------------------
BREAKDOWN_PARTS = (
    ("watch", "create returned -> the operator's watch showed the job"),
    ("queue", "-> a reconcile taken for it (resync loop: a free slot, operator.maxConcurrentReconciles)"),
    ("lock", "-> it holds the job's lock"),
    ("earlier", "reconciles before the one that created the pods"),
    ("before-children", "the creating reconcile until its children are sent (plan, status reads)"),
    ("children-api", "Service, ConfigMaps, ServiceAccount, Role, RoleBinding: API round trips"),
    ("before-pods", "children answered -> pod creates sent (steps between)"),
    ("pods-api", "pod creates sent -> answered (API round trips, the API pool's queue included)"),
    ("back", "pods answered -> the last pod in the bench's pod watch"),
)


def trace_path(log_dir: Path, label: str) -> Path:
    """Where the operator of side `label` writes its trace (`RLJOB_TRACE_FILE`)."""
    return log_dir / f"rljob-bench-trace-{label.replace(' ', '-')}.jsonl"


def read_trace(path: Path) -> dict[str, list[tuple[str, float]]]:
    """job name -> [(event, t)] in order, from the operator's `RLJOB_TRACE_FILE` (empty if none)."""
    out: dict[str, list[tuple[str, float]]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short when the operator stopped
        out.setdefault(rec["job"].rsplit("/", 1)[-1], []).append((rec["event"], float(rec["t"])))
    return out


def job_parts(events: list[tuple[str, float]], created: float, pods_seen: float) -> dict[str, float] | None:
    """One job's latency split into `BREAKDOWN_PARTS` (seconds; they add up to create -> all pods),
    or None when its trace lacks the pod creates."""
    first = {}
    for name, t in events:
        first.setdefault(name, t)
    if not {"seen", "lock", "start", "pods", "pods-done"} <= first.keys():
        return None
    pods_at = first["pods"]
    creating = max(t for name, t in events if name == "start" and t <= pods_at)  # its reconcile
    children = [t for name, t in events if name == "children" and creating <= t <= pods_at]
    children_done = [t for name, t in events if name == "children-done" and creating <= t <= pods_at]
    sent = children[0] if children else creating
    answered = children_done[0] if children_done else sent
    seen = max(first["seen"], created)  # the watch can show the job before the create call returns
    return {
        "watch": seen - created,
        "queue": max(0.0, first["lock"] - seen),
        "lock": max(0.0, first["start"] - max(first["lock"], seen)),
        "earlier": max(0.0, creating - max(first["start"], seen)),
        "before-children": sent - creating,
        "children-api": answered - sent,
        "before-pods": pods_at - answered,
        "pods-api": first["pods-done"] - pods_at,
        "back": pods_seen - first["pods-done"],
    }


def latency_breakdown(
    trace: dict[str, list[tuple[str, float]]],
    created: dict[str, float],
    pods: dict[str, float],
    bound: dict[str, float],
) -> dict[str, Any]:
    """Mean and p99 of each part of create -> all pods over the jobs, the mean over the slowest 1 %,
    and the scheduler's part after it (pods seen -> all bound). Empty without a trace."""
    rows: list[tuple[float, dict[str, float]]] = []
    scheduler: list[float] = []
    for name, t in created.items():
        mine = [f"{name}-trainer-0", f"{name}-rollout-0"]
        if not all(p in pods for p in mine) or name not in trace:
            continue
        seen = max(pods[p] for p in mine)
        parts = job_parts(trace[name], t, seen)
        if parts is None:
            continue
        rows.append((seen - t, parts))
        if all(p in bound for p in mine):
            scheduler.append(max(0.0, max(bound[p] for p in mine) - seen))
    if not rows:
        return {}
    rows.sort(key=lambda r: r[0])
    slow = rows[-max(1, len(rows) // 100) :]
    names_ = [n for n, _ in BREAKDOWN_PARTS]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    return {
        "jobs": len(rows),
        "latency_mean_s": mean([r[0] for r in rows]),
        "latency_p99_s": percentile([r[0] for r in rows], 0.99),
        "slowest_jobs": len(slow),
        "slowest_latency_mean_s": mean([r[0] for r in slow]),
        "parts": {
            n: {
                "mean_s": mean([p[n] for _, p in rows]),
                "p99_s": percentile([p[n] for _, p in rows], 0.99),
                "slowest_mean_s": mean([p[n] for _, p in slow]),
            }
            for n in names_
        },
        "scheduler": {"mean_s": mean(scheduler), "p99_s": percentile(scheduler, 0.99) if scheduler else 0.0},
    }


def api_pool_timing(port: int) -> dict[str, float]:
    """The operator's API pool histograms' _sum and _count (an operator without them: empty)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("rljob_operator_api_queue_seconds", "rljob_operator_api_request_seconds"):
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix + " "):
                    out[name + suffix] = float(line.rsplit(" ", 1)[1])
    return out


_DURATION_RE = re.compile(
    r"^apiserver_request_duration_seconds_(?P<kind>sum|count)\{(?P<labels>[^}]*)\} (?P<v>\S+)$"
)


def apiserver_write_latency(cluster: Any, resources: set[str]) -> tuple[float, float]:
    """(seconds, requests) the apiserver spent serving creates and patches of RLJobs, their children
    and Events (its own `apiserver_request_duration_seconds`): the server's share of a round trip."""
    text = cluster.kubectl("get", "--raw", "/metrics", timeout=60).stdout
    total = count = 0.0
    for line in text.splitlines():
        m = _DURATION_RE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        if labels.get("verb") not in ("POST", "PATCH") or labels.get("resource") not in resources | {
            "events"
        }:
            continue
        if m.group("kind") == "sum":
            total += float(m.group("v"))
        else:
            count += float(m.group("v"))
    return total, count


def api_pool_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds an API call waited for a pool thread and then took, over the create phase."""
    out = {}
    for name, key in (("queue_mean_s", "rljob_operator_api_queue_seconds"),
                      ("request_mean_s", "rljob_operator_api_request_seconds")):  # fmt: skip
        calls = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
        total = after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
        out[name] = total / calls if calls > 0 else 0.0
        out["calls"] = calls
    return out


def print_breakdown(label: str, b: dict[str, Any]) -> None:
    print()
    print(
        f"{label}: where create -> all pods goes ({b['jobs']} jobs traced; mean {b['latency_mean_s']:.3f} s, "
        f"p99 {b['latency_p99_s']:.3f} s; the slowest {b['slowest_jobs']}: "
        f"mean {b['slowest_latency_mean_s']:.3f} s)"
    )
    print("| part | what | mean s | p99 s | slowest 1 % mean s |")
    print("|---|---|---:|---:|---:|")
    for name, what in BREAKDOWN_PARTS:
        p = b["parts"][name]
        print(f"| {name} | {what} | {p['mean_s']:.3f} | {p['p99_s']:.3f} | {p['slowest_mean_s']:.3f} |")
    s = b["scheduler"]
    print(
        f"| scheduler | after it: the last pod seen -> both bound | {s['mean_s']:.3f} | {s['p99_s']:.3f} | |"
    )
    if "operator_cpu_s_per_job" in b:
        print(
            f"operator CPU: {b['operator_cpu_s_per_job'] * 1000:.0f} ms per job over the create phase "
            "(its event loop runs the watches, the reconciles and the API client's serialization)"
        )
    pool = b.get("api_pool") or {}
    if pool.get("calls"):
        print(
            f"API round trips: {pool['calls']:.0f} calls during the create phase waited "
            f"{pool['queue_mean_s']:.3f} s "
            f"for one of the operator's API threads and then took {pool['request_mean_s']:.3f} s (means), "
            f"of which the apiserver served creates and patches in {pool.get('server_mean_s', 0.0):.3f} s"
        )
