"""The Grafana dashboard queries only metrics the code really exports.

Operator series come from `rljob_operator.kube.metrics.REGISTRY` (counters export `_total`, histograms
`_bucket`/`_sum`/`_count`). Trainer series are scraped from a real driver's Prometheus endpoint
after two GRPO steps of the tiny model, so a renamed or dropped driver metric fails here.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from pathlib import Path

import pytest
from trainer_configs import toy_config

from rljob_operator.kube import metrics
from rljob_trainer import driver
from rljob_trainer.outputs import telemetry_sink

pytestmark = [pytest.mark.torch]

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "rljob" / "dashboards" / "rljob.json"
_PROMQL_FUNCTIONS = {"rate", "increase", "sum", "histogram_quantile", "label_values"}


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def queried_metrics(exprs: list[str]) -> set[str]:
    """Series names in PromQL: `rljob_...` identifiers (label names here never start with rljob_)."""
    return {m for e in exprs for m in re.findall(r"\b(rljob_[A-Za-z0-9_]+)\b", e)} - _PROMQL_FUNCTIONS


def operator_series() -> set[str]:
    out: set[str] = set()
    for family in metrics.REGISTRY.collect():
        if family.type == "counter":
            out.add(family.name + "_total")
        elif family.type == "histogram":
            out.update(family.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            out.add(family.name)
    return out


def trainer_series(tmp_path: Path) -> set[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = toy_config(
        grpo={"maxSteps": 2, "promptsPerStep": 4, "groupSize": 4},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        export={"final": False, "everyCheckpoint": False},
    )
    sink = telemetry_sink.TelemetrySink(
        enabled=False, job_name=None, namespace=None, configmap_name=None, prometheus_port=port
    )
    d = driver.GRPODriver(cfg, driver.LocalRuntime(cfg), sink=sink)
    try:
        d.run()
    finally:
        d.shutdown()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {line.split()[0].split("{")[0] for line in body.splitlines() if line.startswith("rljob_")}


def test_every_dashboard_metric_is_exported(tmp_path: Path) -> None:
    wanted = queried_metrics(dashboard_queries())
    operator_wanted = {m for m in wanted if m.startswith("rljob_operator_")}
    trainer_wanted = wanted - operator_wanted
    # The panels: both halves are there.
    assert {
        "rljob_operator_reconcile_duration_seconds_bucket",
        "rljob_operator_jobs",
        "rljob_operator_decisions_total",
        "rljob_operator_api_errors_total",
    } <= operator_wanted
    assert {
        "rljob_mean_reward",
        "rljob_step_s",
        "rljob_dp_balance_imbalance_after",
        "rljob_engines_awake",
    } <= (trainer_wanted)
    assert operator_wanted - operator_series() == set()
    served = trainer_series(tmp_path)
    assert trainer_wanted - served == set(), f"served: {sorted(served)}"
