"""`rljob status` and `rljob logs` (also `kubectl rljob ...`): how a user watches one run.

Role: `status` reads the RLJob, its telemetry ConfigMap (`<job>-telemetry`, the SyncReport history
the driver writes) and its Events, and prints phase, plan, progress, conditions, terminal plots of
the history (reward, loss, tokens/s, engines awake over steps; plotext) and the adaptive decisions
with their reasons and times. `logs` streams a pod's log through the API (what `kubectl logs`
does). `build_status_view` and `render_status` are pure (objects in, text out); `fetch_*`, `cmd_*`
are the shell. Callers: `rljob_operator.cli.commands` (subcommands `status`, `logs`; the `kubectl-rljob`
console script is the same entry point, so kubectl finds it as a plugin).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from rljob_operator import api, names
from rljob_trainer.outputs import telemetry

# Curves drawn into another plot's panel, with a legend: the held-out reward beside the training one,
# at the steps it scored (series key, label, key of its steps).
OVERLAYS: dict[str, tuple[str, str, str]] = {"mean_reward": ("eval_mean_reward", "eval", "eval_step")}
PLOTS: tuple[tuple[str, str], ...] = (
    ("reward", "mean_reward"),
    ("loss", "loss"),
    ("tokens/s", "tokens_per_s"),
    ("engines awake", "engines_awake"),
)


# ---- pure: objects -> view -> text ---------------------------------------------------------------
def _age(then: str | None, now: datetime) -> str:
    if not then:
        return "-"
    t = datetime.fromisoformat(then.replace("Z", "+00:00"))
    s = max(0, int((now - t).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"


def _value(x: float | None) -> float:
    """A reported value, NaN where the driver reported none (not finite, or no evaluation then)."""
    return float("nan") if x is None else x


def _series(reports: Sequence[telemetry.SyncReport]) -> dict[str, list[float]]:
    return {
        "step": [float(r.step) for r in reports],
        "mean_reward": [_value(r.mean_reward) for r in reports],
        "eval_mean_reward": [_value(r.eval_mean_reward) for r in reports],
        "eval_step": [float(r.step if r.eval_step is None else r.eval_step) for r in reports],
        "loss": [_value(r.loss) for r in reports],
        "tokens_per_s": [r.tokens_per_s for r in reports],
        "engines_awake": [float(r.shared_engines_awake + r.dedicated_engines) for r in reports],
    }


def decisions_from_events(events: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The adaptive decisions (`Adaptive*` Events the operator posts), oldest first."""
    out = []
    for ev in events:
        reason = str(ev.get("reason") or "")
        if not reason.startswith("Adaptive"):
            continue
        when = (
            ev.get("lastTimestamp")
            or ev.get("eventTime")
            or (ev.get("metadata") or {}).get("creationTimestamp")
        )
        out.append(
            {
                "time": str(when or ""),
                "action": reason[len("Adaptive") :] or reason,
                "reason": str(ev.get("message") or ""),
                "count": str(ev.get("count") or 1),
            }
        )
    return sorted(out, key=lambda d: d["time"])


def build_status_view(
    rljob: Mapping[str, Any],
    reports: Sequence[telemetry.SyncReport],
    events: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Everything `rljob status` shows, as JSON-ready data (`-o json` prints exactly this)."""
    meta = rljob.get("metadata") or {}
    status = api.RLJobStatus.model_validate(rljob.get("status") or {})
    decisions = decisions_from_events(events)
    if not decisions and status.rollout and status.rollout.last_decision:
        r = status.rollout
        decisions = [
            {
                "time": api.format_time(r.last_decision_time) if r.last_decision_time else "",
                "action": r.last_decision,
                "reason": r.last_decision_reason or "",
                "count": "1",
            }
        ]
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "created": meta.get("creationTimestamp"),
        "status": status.to_k8s(),
        "history": [r.model_dump(mode="json", by_alias=True) for r in reports],
        "series": _series(reports),
        "decisions": decisions,
    }


def _points(steps: Sequence[float], values: Sequence[float]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in zip(steps, values, strict=True) if math.isfinite(y)]


def _columns(points: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    return [x for x, _ in points], [y for _, y in points]


def render_plots(series: Mapping[str, Sequence[float]], *, width: int, height: int = 10) -> str:
    """The history as terminal line plots, two per row (plotext, no colours)."""
    import plotext as plt

    steps = list(series["step"])
    if not steps:
        return "  (no sync points reported yet)"
    plt.clear_figure()
    plt.theme("clear")
    rows = (len(PLOTS) + 1) // 2
    plt.subplots(rows, 2)
    plt.plotsize(width, height * rows)
    for i, (title, key) in enumerate(PLOTS):
        plt.subplot(i // 2 + 1, i % 2 + 1)
        overlay = OVERLAYS.get(key)
        # NaN marks a step without a value (a loss that was not finite, no evaluation at that step)
        extra = _points(series[overlay[2]], series[overlay[0]]) if overlay else []
        label = {"label": "train"} if extra else {}
        plt.plot(*_columns(_points(steps, series[key])), marker="braille", **label)
        if overlay and extra:
            plt.plot(*_columns(extra), marker="braille", label=overlay[1])
        plt.title(title)
        plt.xlabel("step")
    text = plt.uncolorize(plt.build())
    plt.clear_figure()
    return str(text)


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


TRAINER_PLAN = (
    ("trainer accelerators", "trainerAccelerators"),
    ("rollout accelerators", "rolloutAccelerators"),
    ("dedicated engines", "rolloutEngines"),
    ("shared engines", "sharedEngines"),
    ("tensor parallel", "tensorParallel"),
)
ENGINE_PLAN = (
    ("KV bytes/token", "kvBytesPerToken"),
    ("KV cache tokens", "kvCacheTokens"),
    ("maxNumSeqs", "maxNumSeqs"),
    ("maxNumBatchedTokens", "maxNumBatchedTokens"),
)
PROGRESS = (
    ("reward", "meanReward"),
    ("eval reward", "evalReward"),
    ("loss", "loss"),
    ("tokens/s", "tokensPerSecond"),
)
ROLLOUT = (
    ("engines awake", "enginesAwakeTotal"),
    ("desired dedicated", "desiredDedicatedEngines"),
    ("desired shared awake", "desiredSharedAwake"),
    ("idle accelerators", "idleAccelerators"),
)


# The last step's update numerics (SyncReport.numerics, verl's metric names where they mean the same).
NUMERICS = (
    ("entropy", "entropy"),
    ("ppo_kl", "ppo_kl"),
    ("pg_clipfrac", "pg_clipfrac"),
    ("pg_clipfrac_lower (dual-clip)", "pg_clipfrac_lower"),
    ("out of nucleus", "out_of_nucleus_fraction"),
)
ROLLOUT_NUMERICS = (
    ("|log-prob gap|", "rollout/logprob_diff"),
    ("KL(rollout||trainer)", "rollout_corr/kl"),
    ("PPL ratio", "rollout_corr/ppl_ratio"),
    ("chi2", "rollout_corr/chi2_token"),
    ("IS masked", "rollout_corr/rollout_is_oob_ratio"),
    ("rejected", "rollout_corr/rollout_rs_masked_fraction"),
)


def _numerics_lines(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The latest report's update numerics and engine-vs-trainer drift (none from an older driver)."""
    last = (history[-1].get("numerics") or {}) if history else {}
    if not last:
        return []

    def show(key: str) -> str:
        value = last.get(key)
        return "-" if value is None else f"{value:.4g}"

    return [
        f"Numerics (step {history[-1].get('step', '-')}):",
        "  " + ", ".join(f"{label} {show(key)}" for label, key in NUMERICS),
        "  engine vs trainer: " + ", ".join(f"{label} {show(key)}" for label, key in ROLLOUT_NUMERICS),
    ]


def _engine_lines(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """What the engines' platform said it can do, and the last wake of a shared engine."""
    platform = next((h.get("enginePlatform") for h in reversed(history) if h.get("enginePlatform")), None)
    wake = next((h for h in reversed(history) if h.get("sharedWakeS") is not None), None)
    out = [f"  engines: {platform}"] if platform else []
    if wake is not None:
        how = "started again (no sleep mode)" if wake.get("sharedWakeRestarted") else "woke from sleep"
        out.append(f"  last shared-engine wake: step {wake.get('step')}, {wake['sharedWakeS']:.1f} s, {how}")
    return out


def _fields(obj: Mapping[str, Any], fields: Sequence[tuple[str, str]]) -> str:
    return "  " + ", ".join(f"{label} {obj.get(key, '-')}" for label, key in fields)


def _elastic_lines(roll: Mapping[str, Any]) -> list[str]:
    """Rollout pods draining before they go, and those recreated alone after an engine loss."""
    out = []
    draining = roll.get("drainingPods") or []
    if draining:
        pods = ", ".join(f"rollout-{d.get('index')} (since {d.get('since')})" for d in draining)
        out.append(f"  draining {pods}")
    if roll.get("replacedPods"):
        out.append(f"  rollout pods replaced after an engine loss: {roll['replacedPods']}")
    return out


def render_status(view: Mapping[str, Any], *, now: datetime, width: int = 100, plots: bool = True) -> str:
    """The `rljob status` text for one job."""
    st = view["status"]
    prog = st.get("progress") or {}
    plan = st.get("plan") or {}
    roll = st.get("rollout") or {}
    step = prog.get("step")
    lines = [
        f"RLJob {view['namespace']}/{view['name']}   phase: {st.get('phase', 'Pending')}   "
        f"step: {step if step is not None else '-'}/{prog.get('maxSteps', '-')}   "
        f"restarts: {st.get('restarts', 0)}   age: {_age(view.get('created'), now)}",
        "",
        "Plan:",
        _fields(plan, TRAINER_PLAN),
        _fields(plan, ENGINE_PLAN),
        "Progress:",
        _fields(prog, PROGRESS) + f", last sync {_age(prog.get('lastSyncTime'), now)} ago",
        f"  export {prog.get('exportPath') or '-'}",
        "Rollout:",
        _fields(roll, ROLLOUT),
        *_engine_lines(view["history"]),
        *_elastic_lines(roll),
        *_numerics_lines(view["history"]),
        "",
        "Conditions:",
    ]
    conds = st.get("conditions") or []
    if conds:
        rows = [("TYPE", "STATUS", "REASON", "AGE", "MESSAGE")] + [
            (
                c["type"],
                c["status"],
                c.get("reason", ""),
                _age(c.get("lastTransitionTime"), now),
                (c.get("message") or "")[: max(20, width - 50)],
            )
            for c in conds
        ]
        lines += _table(rows)
    else:
        lines.append("  (none yet)")
    lines += ["", f"Sync points ({len(view['history'])} reported):"]
    if plots:
        lines.append(render_plots(view["series"], width=width))
    else:
        rows = [("STEP", "REWARD", "LOSS", "TOKENS/S", "ENGINES")] + [
            (str(int(s)), f"{r:.4g}", f"{lo:.4g}", f"{t:.1f}", str(int(e)))
            for s, r, lo, t, e in zip(
                *(
                    view["series"][k]
                    for k in ("step", "mean_reward", "loss", "tokens_per_s", "engines_awake")
                ),
                strict=True,
            )
        ]
        lines += _table(rows)
    lines += ["", "Adaptive decisions:"]
    if view["decisions"]:
        rows = [("TIME", "ACTION", "COUNT", "REASON")] + [
            (d["time"], d["action"], d["count"], d["reason"]) for d in view["decisions"]
        ]
        lines += _table(rows)
    else:
        lines.append("  (none)")
    return "\n".join(lines) + "\n"


# ---- shell: the API -------------------------------------------------------------------------------
def _clients(kubeconfig: str | None, context: str | None) -> tuple[Any, Any]:
    from kubernetes import client
    from kubernetes import config as kube_config

    try:
        kube_config.load_kube_config(config_file=kubeconfig, context=context)
    except kube_config.ConfigException:
        kube_config.load_incluster_config()
    return client.CoreV1Api(), client.CustomObjectsApi()


def _namespace(explicit: str | None, context: str | None) -> str:
    if explicit:
        return explicit
    from kubernetes import config as kube_config

    try:
        _, active = kube_config.list_kube_config_contexts()
        if context:
            contexts, _ = kube_config.list_kube_config_contexts()
            active = next((c for c in contexts if c["name"] == context), active)
        return str((active or {}).get("context", {}).get("namespace") or "default")
    except Exception:
        return "default"


def read_reports(core: Any, namespace: str, name: str) -> list[Any]:
    """The job's SyncReport history from its telemetry ConfigMap ([] before the trainer wrote one)."""
    from kubernetes.client.rest import ApiException

    try:
        cm = core.read_namespaced_config_map(names.telemetry_config_map_name(name), namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return []
    return telemetry.parse_reports((cm.data or {}).get(telemetry.REPORTS_KEY))


def fetch_status_view(core: Any, custom: Any, namespace: str, name: str) -> dict[str, Any]:
    """Read the RLJob, its telemetry history and its Events; raises ApiException (404: no such job)."""
    rljob = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    reports = read_reports(core, namespace, name)
    selector = f"involvedObject.name={name},involvedObject.kind={api.KIND}"
    raw = core.list_namespaced_event(namespace, field_selector=selector, _preload_content=False)
    events = json.loads(raw.data).get("items", [])
    return build_status_view(rljob, reports, events)


def cmd_status(args: argparse.Namespace) -> int:
    from kubernetes.client.rest import ApiException

    core, custom = _clients(args.kubeconfig, args.context)
    namespace = _namespace(args.namespace, args.context)
    try:
        view = fetch_status_view(core, custom, namespace, args.name)
    except ApiException as exc:
        if exc.status == 404:
            print(f"rljob status: RLJob {args.name!r} not found in namespace {namespace!r}", file=sys.stderr)
            return 1
        raise
    if args.output == "json":
        print(json.dumps(view, indent=2, sort_keys=True))
    else:
        now = datetime.now(timezone.utc)
        sys.stdout.write(render_status(view, now=now, width=args.width, plots=not args.no_plots))
    return 0


def pod_for(job: str, pod: str) -> str:
    """`trainer-0` / `rollout-1` (or a full pod name) -> the pod's name."""
    return pod if pod.startswith(f"{job}-") else f"{job}-{pod}"


def cmd_logs(args: argparse.Namespace) -> int:
    from kubernetes.client.rest import ApiException

    core, _ = _clients(args.kubeconfig, args.context)
    namespace = _namespace(args.namespace, args.context)
    pod = pod_for(args.name, args.pod)
    kwargs: dict[str, Any] = {"follow": args.follow, "_preload_content": False}
    if args.tail is not None:
        kwargs["tail_lines"] = args.tail
    if args.insecure_skip_tls_verify_backend:
        kwargs["insecure_skip_tls_verify_backend"] = True
    try:
        resp = core.read_namespaced_pod_log(pod, namespace, **kwargs)
    except ApiException as exc:
        if exc.status == 404:
            pods = core.list_namespaced_pod(namespace, label_selector=f"{names.LABEL_JOB}={args.name}")
            have = ", ".join(sorted(p.metadata.name for p in pods.items)) or "none"
            print(
                f"rljob logs: pod {pod!r} not found in namespace {namespace!r} (pods of {args.name}: {have})",
                file=sys.stderr,
            )
            return 1
        print(f"rljob logs: {pod}: {exc.status} {exc.reason}: {exc.body}", file=sys.stderr)
        return 1
    try:
        for chunk in resp.stream(4096):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
    finally:
        resp.release_conn()
    return 0


def add_subcommands(sub: Any) -> None:
    """Register `status` and `logs` on the `rljob` parser's subparsers."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("name", help="the RLJob's name")
        p.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's)")
        p.add_argument("--kubeconfig", help="kubeconfig file (default $KUBECONFIG or ~/.kube/config)")
        p.add_argument("--context", help="kubeconfig context")

    status = sub.add_parser("status", help="phase, plan, conditions, curves and decisions of an RLJob")
    common(status)
    status.add_argument("-o", "--output", choices=["text", "json"], default="text")
    status.add_argument("--width", type=int, default=100, help="plot width in characters")
    status.add_argument("--no-plots", action="store_true", help="a table of the sync points instead")
    status.set_defaults(func=cmd_status)

    logs = sub.add_parser("logs", help="a pod's log of an RLJob (default trainer-0, the driver)")
    common(logs)
    logs.add_argument("--pod", default="trainer-0", help="trainer-<i>, rollout-<j> or a full pod name")
    logs.add_argument("-f", "--follow", action="store_true", help="keep streaming")
    logs.add_argument("--tail", type=int, help="only the last N lines")
    logs.add_argument(
        "--insecure-skip-tls-verify-backend",
        action="store_true",
        help="as kubectl logs: do not verify the kubelet's serving certificate",
    )
    logs.set_defaults(func=cmd_logs)
