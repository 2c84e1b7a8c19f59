"""The `rljob` command: plan or render a job offline (or refit a running job's plan from its
measurements: `rljob plan --from-job`), validate manifests, generate the CRD, run the operator.

Entry point of the `rljob` console script. A thin shell: every subcommand parses its flags and calls
one function of the core (`planning.plan_job`, `crd.write_crds`, `handlers.run_operator`, the latter
inside `leader.run_as_leader` unless `--no-leader-election`). kopf is
imported only by `rljob operator`, so `plan`, `validate` and `crd` work with the core install alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rljob_operator import api
from rljob_operator import estimator as est
from rljob_operator.api import crd
from rljob_operator.cli import console
from rljob_operator.decide import planning

REPO_ROOT = Path(__file__).resolve().parents[3]  # operator/rljob_operator/cli/commands.py
# The generated CRD and its copy in the Helm chart (helm installs what is in the chart's crds/).
REPO_CRD_DIRS = (REPO_ROOT / "crds", REPO_ROOT / "helm" / "rljob" / "crds")


def _read_rljobs(path: str) -> list[dict[str, Any]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    docs = [doc for doc in api.load_manifests(text) if doc.get("kind") == api.KIND]
    if not docs:
        raise SystemExit(f"{path}: no {api.KIND} in this file")
    return docs


def _parse_spec(doc: dict[str, Any], source: str) -> api.RLJobSpec:
    name = (doc.get("metadata") or {}).get("name", "?")
    try:
        return api.RLJobSpec.model_validate(doc.get("spec") or {})
    except ValidationError as exc:
        lines = "\n  ".join(api.describe_validation_error(exc, prefix="spec"))
        raise SystemExit(f"{source}: RLJob {name!r} is invalid:\n  {lines}") from None


def _model_config(spec: api.RLJobSpec, override: str | None) -> dict[str, Any]:
    if override:
        return dict(json.loads(Path(override).read_text(encoding="utf-8")))
    source = spec.model.config
    if source.inline is not None:
        return dict(source.inline)
    if source.preset is not None:
        return est.load_preset(source.preset)
    raise SystemExit(
        "spec.model.config.configMapRef is read by the operator from the cluster; offline, pass the file "
        "with "
        "--model-config path/to/config.json"
    )


def _judge_config(spec: api.RLJobSpec, override: str | None) -> dict[str, Any] | None:
    """The judge model's config.json (spec.reward.judge.model.config; None without a judge)."""
    source = planning.judge_config_source(spec)
    if source is None:
        return None
    if override:
        return dict(json.loads(Path(override).read_text(encoding="utf-8")))
    if source.inline is not None:
        return dict(source.inline)
    if source.preset is not None:
        return est.load_preset(source.preset)
    raise SystemExit(
        "spec.reward.judge.model.config.configMapRef is read by the operator from the cluster; offline, pass "
        "the file with --judge-model-config path/to/config.json"
    )


def _print_plan(plan: est.ResourcePlan, output: str, title: str, judge: est.JudgePlan | None = None) -> None:
    if output == "json":
        data = est.plan_to_json(plan)
        if judge is not None:
            data["judge"] = judge.model_dump(mode="json", by_alias=True)
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(f"# {title}")
        print(est.format_plan_table(plan))
        if judge is not None:
            print(est.format_judge(judge))


def _job_model_config(core: Any, namespace: str, spec: api.RLJobSpec, override: str | None) -> dict[str, Any]:
    """The model config the operator planned the job with (a configMapRef is read from the cluster)."""
    ref = spec.model.config.config_map_ref
    if override or ref is None:
        return _model_config(spec, override)
    data = core.read_namespaced_config_map(ref.name, namespace).data or {}
    if ref.key not in data:
        raise SystemExit(f"ConfigMap {ref.name!r} has no key {ref.key!r} (spec.model.config.configMapRef)")
    return dict(json.loads(data[ref.key]))


def cmd_plan_from_job(args: argparse.Namespace) -> int:
    """The job's plan beside what it measured: the plan refitted from its SyncReports."""
    from kubernetes.client.rest import ApiException

    from rljob_operator import names

    core, custom = console._clients(args.kubeconfig, args.context)
    namespace = console._namespace(args.namespace, args.context)
    name = args.from_job
    try:
        rljob = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            print(f"rljob plan: RLJob {name!r} not found in namespace {namespace!r}", file=sys.stderr)
            return 1
        raise
    spec = _parse_spec(rljob, f"RLJob {namespace}/{name}")
    reports = console.read_reports(core, namespace, name)
    model_config = _job_model_config(core, namespace, spec, args.model_config)
    fitted = planning.refit_job(spec, model_config, reports)
    if fitted is None:
        _print_plan(planning.plan_job(spec, model_config), args.output, f"RLJob {namespace}/{name}")
        print(
            f"rljob plan: RLJob {namespace}/{name} has no SyncReport with timed phases and token counts yet "
            f"({len(reports)} report(s) in ConfigMap {names.telemetry_config_map_name(name)}): "
            "nothing to refit",
            file=sys.stderr,
        )
        return 3
    if args.output == "json":
        print(json.dumps(est.refit_to_json(fitted.plan, fitted.fit), indent=2, sort_keys=True))
    else:
        print(f"# RLJob {namespace}/{name}: the plan refitted from the job's measurements")
        print(est.format_refit_table(fitted.plan, fitted.fit))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.from_job:
        try:
            return cmd_plan_from_job(args)
        except est.EstimatorError as exc:
            print(f"rljob plan: {exc.reason}: {exc}", file=sys.stderr)
            return 2
    try:
        if args.filename:
            for doc in _read_rljobs(args.filename):
                spec = _parse_spec(doc, args.filename)
                plan = planning.plan_job(spec, _model_config(spec, args.model_config))
                judge = planning.plan_judge(spec, _judge_config(spec, args.judge_model_config))
                _print_plan(plan, args.output, f"RLJob {doc.get('metadata', {}).get('name', '?')}", judge)
            return 0
        if not args.model_config:
            raise SystemExit(
                "rljob plan: give -f rljob.yaml, or --model-config config.json with flags for the rest"
            )
        request = est.PlanRequest(
            hf_config=json.loads(Path(args.model_config).read_text(encoding="utf-8")),
            accelerator=args.accelerator,
            total_accelerators=args.total_accelerators,
            accelerators_per_node=args.accelerators_per_node,
            mode=args.mode,
            trainer_accelerators=args.trainer_accelerators,
            rollout_accelerators=args.rollout_accelerators,
            tensor_parallel=args.tensor_parallel,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_prompt_tokens=args.max_prompt_tokens,
            max_completion_tokens=args.max_completion_tokens,
            max_model_len=args.max_model_len,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            kv_cache_dtype=args.kv_cache_dtype,
            lora=args.lora,
        )
        _print_plan(est.plan_resources(request), args.output, Path(args.model_config).name)
        return 0
    except est.EstimatorError as exc:
        print(f"rljob plan: {exc.reason}: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(
            "rljob plan: invalid flags:\n  " + "\n  ".join(api.describe_validation_error(exc)),
            file=sys.stderr,
        )
        return 2


def cmd_validate(args: argparse.Namespace) -> int:
    for doc in _read_rljobs(args.filename):
        _parse_spec(doc, args.filename)
        print(f"RLJob {doc.get('metadata', {}).get('name', '?')}: valid")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    """Print every object the operator would create for each RLJob in the manifest."""
    from rljob_operator import errors
    from rljob_operator.cli import render

    out: list[dict[str, Any]] = []
    for doc in _read_rljobs(args.filename):
        meta = doc.get("metadata") or {}
        spec = _parse_spec(doc, args.filename)
        namespace = args.namespace or meta.get("namespace") or "default"
        try:
            out += render.render_job(
                meta.get("name", "rljob"),
                namespace,
                spec,
                _model_config(spec, args.model_config),
                only=args.only,
                gang=args.gang,
                judge_config=_judge_config(spec, args.judge_model_config),
            )
        except errors.RLJobError as exc:
            print(f"rljob render: {exc.reason}: {exc}", file=sys.stderr)
            return 2
    if args.output == "json":
        body: Any = out[0] if args.only == "trainer-config" and len(out) == 1 else {
            "apiVersion": "v1", "kind": "List", "items": out
        }  # fmt: skip
        print(json.dumps(body, indent=2, sort_keys=False))
    else:
        print(yaml.safe_dump_all(out, sort_keys=False), end="")
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    if args.stdout:
        sys.stdout.write(crd.render_crd_yaml())
        return 0
    # From a source checkout, both committed copies; from an installed package, ./crds.
    in_checkout = (REPO_ROOT / "pyproject.toml").exists()
    default = list(REPO_CRD_DIRS) if in_checkout else [Path("crds")]
    directories = [Path(d) for d in args.output_dir] if args.output_dir else default
    if args.check:
        stale = [
            path
            for path in (d / crd.CRD_FILENAME for d in directories)
            if not path.exists() or path.read_text(encoding="utf-8") != crd.render_crd_yaml()
        ]
        for path in stale:
            print(f"{path} is out of date: run `rljob crd` and commit the result", file=sys.stderr)
        if not stale:
            print("CRDs are up to date: " + ", ".join(str(d / crd.CRD_FILENAME) for d in directories))
        return 1 if stale else 0
    for directory in directories:
        for path in crd.write_crds(directory):
            print(f"wrote {path}")
    return 0


def cmd_operator(args: argparse.Namespace) -> int:
    from rljob_operator import handlers  # kopf only here

    def run() -> None:
        handlers.run_operator(
            None if args.all_namespaces else args.namespace,
            liveness_endpoint=args.liveness,
            log_level=args.log_level,
        )

    if not args.leader_election:
        run()
        return 0
    from rljob_operator.kube import kubeclient, leader

    namespace = leader.lease_namespace(args.leader_election_namespace, kubeclient.in_cluster_namespace())
    return leader.run_as_leader(run, namespace=namespace, health_endpoint=args.liveness)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rljob", description="Elastic GRPO jobs on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the resource plan of an RLJob, offline")
    plan.add_argument("-f", "--filename", help="RLJob manifest (YAML, - for stdin)")
    plan.add_argument("-o", "--output", choices=["table", "json"], default="table")
    plan.add_argument("--model-config", help="the model's config.json (overrides the manifest's)")
    plan.add_argument(
        "--judge-model-config", help="the judge model's config.json (needed for its configMapRef)"
    )
    job = plan.add_argument_group(
        "--from-job: the plan of a running or finished job, refitted from its SyncReports"
    )
    job.add_argument("--from-job", metavar="NAME", help="an RLJob in the cluster (current kubeconfig)")
    job.add_argument("-n", "--namespace", help="its namespace (default: the context's)")
    job.add_argument("--kubeconfig", default=None)
    job.add_argument("--context", default=None)
    flags = plan.add_argument_group("without -f: the job's numbers")
    flags.add_argument(
        "--accelerator", default="H100-80GB", help="catalog name, e.g. H100-80GB, H200, Ascend910B3"
    )
    flags.add_argument("--total-accelerators", type=int, default=8)
    flags.add_argument("--accelerators-per-node", type=int, default=8)
    flags.add_argument("--mode", choices=["static", "estimate", "adaptive"], default="estimate")
    flags.add_argument("--trainer-accelerators", type=int)
    flags.add_argument("--rollout-accelerators", type=int)
    flags.add_argument("--tensor-parallel", type=int)
    flags.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    flags.add_argument("--max-prompt-tokens", type=int, default=1024)
    flags.add_argument("--max-completion-tokens", type=int, default=4096)
    flags.add_argument("--max-model-len", type=int)
    flags.add_argument("--prompts-per-step", type=int, default=64)
    flags.add_argument("--group-size", type=int, default=8)
    flags.add_argument("--kv-cache-dtype", default="auto")
    flags.add_argument("--lora", action="store_true")
    plan.set_defaults(func=cmd_plan)

    validate = sub.add_parser("validate", help="check RLJob manifests against the API offline")
    validate.add_argument("-f", "--filename", required=True)
    validate.set_defaults(func=cmd_validate)

    render_cmd = sub.add_parser(
        "render", help="print every object the operator would create for an RLJob, offline"
    )
    render_cmd.add_argument("-f", "--filename", required=True, help="RLJob manifest (YAML, - for stdin)")
    render_cmd.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    render_cmd.add_argument(
        "--only", choices=["all", "trainer-config", "pods", "rbac"], default="all", help="one kind of object"
    )
    render_cmd.add_argument("-n", "--namespace", help="namespace of the objects (default: the manifest's)")
    render_cmd.add_argument("--model-config", help="the model's config.json (needed for configMapRef)")
    render_cmd.add_argument(
        "--judge-model-config", help="the judge model's config.json (needed for its configMapRef)"
    )
    render_cmd.add_argument(
        "--gang",
        action="store_true",
        help="as on a cluster serving scheduling.k8s.io/v1beta1 PodGroups: add the job's PodGroup and "
        "the core pods' schedulingGroup (default: plain pods, as without that API)",
    )
    render_cmd.set_defaults(func=cmd_render)

    crd_cmd = sub.add_parser("crd", help="generate crds/ from the API models")
    crd_cmd.add_argument(
        "--output-dir",
        action="append",
        help="folder to write (repeatable; default: crds/ and helm/rljob/crds/ of this repository)",
    )
    crd_cmd.add_argument("--check", action="store_true", help="fail if the committed CRD is out of date")
    crd_cmd.add_argument("--stdout", action="store_true", help="print the CRD instead of writing it")
    crd_cmd.set_defaults(func=cmd_crd)

    op = sub.add_parser("operator", help="run the operator (kopf) against the current kubeconfig")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", help="watch one namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)")
    op.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    op.add_argument(
        "--log-level",
        default=os.environ.get("RLJOB_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING"],
        help="operator log level (default $RLJOB_LOG_LEVEL or INFO)",
    )
    op.add_argument(
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reconcile only while holding the Lease rljob-operator, so replicas never both write "
        "(default on; --no-leader-election for development)",
    )
    op.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the Lease (default: the pod's own namespace in a cluster, else default)",
    )
    op.set_defaults(func=cmd_operator)

    console.add_subcommands(sub)  # status, logs
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "operator" and not args.namespace:
        args.all_namespaces = True
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
