"""Engine benchmark: one real vLLM engine (vLLM's CPU build) sized by the operator's plan against vLLM's
own defaults, and weight syncs into a real engine through its fallback path, side by side in one run.

Role: measures what the estimator's engine settings buy on the real engine, and what a weight sync
through `VLLMEngine.update_weights` costs per 100 MB against copies that need no engine. Everything
runs in this process: `rljob_trainer.engines.vllm_engine.VLLMEngine` starts vLLM's AsyncLLM (its
EngineCore and worker are processes of their own), as inside a dedicated engine's Ray actor.

The job: an RLJob written here (`bench_spec`) for SmolLM2-135M-Instruct's geometry (its published
config.json: Llama, 30 layers, 9 heads of 64, 3 KV heads, vocabulary 49,152, tied embeddings; random
weights, bfloat16, nothing downloaded) on a CPU pool, planned by the operator's own planner and
rendered into the trainer's config as the operator does (`rljob_operator.decide.planning.plan_job`,
`builders.render_trainer_config`): `rollout.maxNumSeqs`, `maxNumBatchedTokens`, `cpuKvCacheBytes`.
`--model-dir DIR` benches a Hugging Face folder instead (e.g. the real SmolLM2 once it is built).

1. Generation tokens/s, the plan against vLLM's defaults: two engines of the same model, both up at
   once, one started from the rendered config (the plan's max_num_seqs and max_num_batched_tokens),
   the other from the same config with those two at what vLLM resolves when they are not given
   (`AsyncEngineArgs.create_engine_config()` without them, as `AsyncLLM.from_engine_args` resolves
   them: usage context ENGINE_CONTEXT). Both get the plan's KV bytes: vLLM's CPU default reserves
   gpu_memory_utilization x the host's memory (the bench prints what that would be), which no shared
   machine can give two engines. One GRPO step's requests per call (promptsPerStep distinct prompts
   of 32 to maxPromptTokens random token ids, groupSize copies each, a seed per request), the same
   prompts and seeds for both, temperature 1, up to maxCompletionTokens (random weights rarely draw
   EOS). A warm-up call each, then calls in the order A B B A (twice without --quick), so drift
   over the minutes cancels; the ratio is plan tokens/s over defaults tokens/s, each side's
   generated tokens over its calls' wall time.
2. Weight sync per 100 MB of the model's weights (bfloat16, each parameter once), for SmolLM2-135M's
   and SmolLM2-360M's geometries (with --model-dir: that model only): new weights (the engine's moved
   by N(0, 0.02) noise, as `modeling.iter_engine_weights` hands them to an engine) into a running vLLM
   engine through `VLLMEngine.update_weights`, the fallback every engine takes on a platform without
   vLLM's weight-transfer backends (a safetensors file on tmpfs, its path through `collective_rpc`,
   loaded memory-mapped by `Worker.reload_weights`); beside it, alternated, the transformers
   engine's update (an in-process copy into its parameters: what applying the weights costs with no
   process boundary) and a torch.save/torch.load round trip of the same tensors in memory (what
   crossing one process boundary by serialising costs). Medians of 3 (1 with --quick). The engine's log-probs
   of a sampled answer against the new weights' (the in-process model's) are printed after the
   syncs and, for scale, before the first one: a sync that did not arrive cannot read as fast.

Threads: each vLLM worker and this process run `--threads` torch threads (default 1: on a shared
2-core machine a second thread measures the neighbours). The load average is printed at the start
and the end.

Run: `.venv/bin/python bench/engine.py [--quick] [--threads N] [--model-dir DIR] [--json]`. The last
line is
`engine: plan X tokens/s, vLLM defaults Y tokens/s, ratio R; weight sync S s per 100 MB, C x an
in-process copy, P x torch.save/load` (on one line; the sync figures are the largest model's).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "trainer_image")]
# vLLM's INFO lines (three processes' worth per engine) would bury the bench's own.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from rljob_operator import api, builders  # noqa: E402
from rljob_operator.decide import planning  # noqa: E402
from rljob_trainer import config  # noqa: E402

MB = 1_000_000
GIB = 1 << 30

# SmolLM2-135M-Instruct's and SmolLM2-360M-Instruct's config.json (HuggingFaceTB), the fields a
# Llama needs; weights random.
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
SMOLLM2_360M: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_hidden_layers": 32,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
}
MODELS = {"smollm2-135m": SMOLLM2_135M, "smollm2-360m": SMOLLM2_360M}
SPECIAL_TOKENS = 3  # ids 0-2 (unk/pad, bos, eos) never appear in a prompt


# ---- the job, planned and rendered as the operator does ---------------------------------------------
def bench_spec(model_config: dict[str, Any], *, quick: bool) -> dict[str, Any]:
    """The RLJob spec the bench plans: one dedicated engine on a CPU pool (8 GiB a pod)."""
    return {
        "model": {
            "name": "smollm2-geometry",
            "source": {"tiny": {"tokenizer": "builtin-digits"}},
            "config": {"inline": model_config},
            "dtype": "bfloat16",
            "finetune": {"mode": "full"},
        },
        "grpo": {"groupSize": 8, "promptsPerStep": 4 if quick else 8, "maxSteps": 10},
        "lengths": {"maxPromptTokens": 128, "maxCompletionTokens": 64 if quick else 128},
        "data": {"source": {"builtin": {"name": "toy-arithmetic"}}},
        "reward": {"functions": [{"name": "mathAccuracy", "weight": 1.0}]},
        "resources": {
            "accelerator": {"kind": "cpu"},
            "totalAccelerators": 2,
            "acceleratorsPerNode": 1,
            "mode": "static",
            "static": {"trainerAccelerators": 1, "rolloutAccelerators": 1},
            "cpu": "1",
            "memory": "8Gi",
            "rollout": {"kind": "vllm"},
        },
    }


def rendered_config(model_config: dict[str, Any], *, quick: bool) -> tuple[config.TrainerConfig, Any]:
    """(the trainer config the operator renders for the bench job, the plan's status)."""
    spec = api.RLJobSpec.model_validate(bench_spec(model_config, quick=quick))
    plan = planning.plan_status(planning.plan_job(spec, model_config))
    cfg = builders.render_trainer_config(spec, plan, model_config)
    data = cfg.model_dump()
    data["distributed"].update(num_trainer_ranks=1, trainer_pod_ranks=None, launcher="local")
    data["telemetry"].update(enabled=False, prometheus_port=None)
    return config.TrainerConfig.model_validate(data), plan


def with_scheduler(
    cfg: config.TrainerConfig, max_num_seqs: int, max_num_batched_tokens: int
) -> config.TrainerConfig:
    data = cfg.model_dump()
    data["rollout"].update(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return config.TrainerConfig.model_validate(data)


def vllm_resolved(cfg: config.TrainerConfig, model_dir: str, *, drop_scheduler: bool) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM resolves the engine's arguments; with
    `drop_scheduler` as it resolves them when neither is given (its defaults)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from rljob_trainer.engines import platform, vllm_engine

    args = vllm_engine.engine_args(cfg, model=model_dir, sleep_enabled=False, capabilities=platform.probe())
    if drop_scheduler:
        del args["max_num_seqs"], args["max_num_batched_tokens"]
    # What AsyncLLM.from_engine_args passes (its usage context), so these are the engine's numbers.
    scheduler = AsyncEngineArgs(**args).create_engine_config(UsageContext.ENGINE_CONTEXT).scheduler_config
    return int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens)


# ---- models written for vLLM ------------------------------------------------------------------------
def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with one word per id, so vLLM detokenises every id it samples."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(SPECIAL_TOKENS, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )


def build_model(model_config: dict[str, Any], seed: int) -> Any:
    """The model of `model_config` with random weights from `seed`, in bfloat16."""
    import torch
    import transformers

    hf = dict(model_config)
    cfg = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def write_model(model_config: dict[str, Any], out: Path, seed: int = 0) -> Any:
    """A Hugging Face folder vLLM loads (config, bfloat16 safetensors, the word tokenizer) at `out`;
    returns the model it holds."""
    model = build_model(model_config, seed)
    model.save_pretrained(out)
    word_tokenizer(int(model_config["vocab_size"])).save_pretrained(out)
    return model


def load_model(model_dir: Path) -> Any:
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def new_weights(model: Any, seed: int) -> tuple[list[tuple[str, Any]], int, int]:
    """Weights the engine does not have yet, as a trainer sends them: `model`'s parameters moved by
    N(0, 0.02) noise (in place; tied parameters move together, as training moves them), then the
    (name, tensor) pairs `modeling.iter_engine_weights` yields in bfloat16. Also (the model's weight
    bytes, its parameters), each parameter once."""
    import torch

    from rljob_trainer.model import modeling

    params = list(model.parameters())  # tied parameters once
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for param in params:
            param.add_(torch.randn_like(param) * 0.02)
    weights = list(modeling.iter_engine_weights(model, torch.bfloat16))
    return weights, sum(q.numel() * q.element_size() for q in params), sum(q.numel() for q in params)


# ---- 1. generation: the plan against vLLM's defaults ----------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    seeds: tuple[int, ...]
    max_tokens: int


def step_workload(cfg: config.TrainerConfig, vocab_size: int) -> Workload:
    """One GRPO step's requests: promptsPerStep prompts of random ids, groupSize copies each."""
    rng = random.Random(0)
    g, cap = cfg.grpo, cfg.lengths.max_prompt_tokens
    distinct = [
        [rng.randrange(SPECIAL_TOKENS, vocab_size) for _ in range(rng.randint(min(32, cap), cap))]
        for _ in range(g.prompts_per_step)
    ]
    prompts = [p for p in distinct for _ in range(g.group_size)]
    return Workload(prompts, tuple(range(len(prompts))), cfg.lengths.max_response_tokens)


@dataclass(frozen=True)
class Call:
    side: str
    seconds: float
    generated_tokens: int
    prompt_tokens: int


def timed_generate(engine: Any, work: Workload, side: str) -> Call:
    from rljob_trainer.engines import base

    sampling = base.SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=work.max_tokens, seeds=work.seeds)
    started = time.perf_counter()
    outs = engine.generate(work.prompts, sampling)
    seconds = time.perf_counter() - started
    return Call(side, seconds, sum(len(o.token_ids) for o in outs), sum(len(p) for p in work.prompts))


def tokens_per_s(calls: list[Call], side: str) -> float:
    mine = [c for c in calls if c.side == side]
    return sum(c.generated_tokens for c in mine) / sum(c.seconds for c in mine)


def paired_ratios(calls: list[Call]) -> list[float]:
    """Plan over defaults tokens/s of neighbouring calls (A B, then B A, ...): their scatter is the noise."""
    out = []
    for a, b in zip(calls[::2], calls[1::2], strict=False):
        plan, default = (a, b) if a.side == "plan" else (b, a)
        out.append((plan.generated_tokens / plan.seconds) / (default.generated_tokens / default.seconds))
    return out


def vllm_default_kv_bytes(cfg: config.TrainerConfig) -> tuple[int, int]:
    """(what vLLM's CPU worker would reserve for the KV cache without kv_cache_memory_bytes:
    gpu_memory_utilization x the host's memory; the memory available now), in bytes."""
    import psutil

    mem = psutil.virtual_memory()
    return int(mem.total * cfg.rollout.gpu_memory_utilization), int(mem.available)


# ---- 2. weight sync ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncFigures:
    model: str
    parameters: int
    weight_bytes: int  # the model's weights in bfloat16, each parameter once
    sent_bytes: int  # what the trainer's pairs hold (a tied embedding twice: see `new_weights`)
    vllm_s: float  # VLLMEngine.update_weights (the tmpfs-file fallback), median
    copy_s: float  # TransformersEngine.update_weights (in-process copy), median
    save_load_s: float  # torch.save + torch.load of the same pairs in memory, median
    logprob_max_abs_diff: float  # engine vs in-process model after the sync (bfloat16)
    logprob_max_abs_diff_unsynced: float  # the same before the first sync: what "not arrived" reads
    engine_start_s: float

    @property
    def vllm_s_per_100mb(self) -> float:
        return self.vllm_s / (self.weight_bytes / (100 * MB))


def save_load(weights: list[tuple[str, Any]]) -> float:
    import torch

    started = time.perf_counter()
    buf = io.BytesIO()
    torch.save(dict(weights), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)
    return time.perf_counter() - started


def logprob_gap(engine: Any, reference: Any, vocab_size: int) -> float:
    """Largest |log-prob| difference over a sampled answer: the engine's (vLLM's processed log-probs at
    temperature 1) against the in-process model's for the same tokens."""
    import torch

    from rljob_trainer.engines import base

    rng = random.Random(1)
    prompts = [[rng.randrange(SPECIAL_TOKENS, vocab_size) for _ in range(24)] for _ in range(2)]
    outs = engine.generate(prompts, base.SamplingSettings(1.0, 1.0, 8, seeds=(0, 1)))
    gap = 0.0
    for o in outs:
        ids = torch.tensor([[*o.prompt_token_ids, *o.token_ids]])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0].float()
        n = len(o.prompt_token_ids)
        logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
        mine = logp[torch.arange(len(o.token_ids)), torch.tensor(o.token_ids)]
        gap = max(gap, float((mine - torch.tensor(o.logprobs)).abs().max()))
    return gap


def measure_sync(
    name: str,
    model: Any,
    model_dir: Path,
    cfg: config.TrainerConfig,
    engine: Any,
    *,
    repeats: int,
    log: Any,
) -> SyncFigures:
    """The three ways of applying new weights, alternated `repeats` times (medians); `model` holds
    the engine's weights (those in `model_dir`) and is moved to the new ones."""
    from rljob_trainer.engines import transformers_engine

    copier = transformers_engine.TransformersEngine(
        in_process_cfg(cfg, model_dir), name=f"{name}-in-process", colocated=False
    )
    copier.load()
    times: dict[str, list[float]] = {"vllm": [], "copy": [], "save_load": []}
    vocab_size = int(model.config.vocab_size)
    unsynced = math.nan
    for version in range(1, repeats + 1):
        weights, nbytes, parameters = new_weights(model, seed=version)
        if version == 1:  # the engine still has the folder's weights, `model` the new ones
            unsynced = logprob_gap(engine, model, vocab_size)
        started = time.perf_counter()
        engine.update_weights(weights, version)
        times["vllm"].append(time.perf_counter() - started)
        started = time.perf_counter()
        copier.update_weights(weights, version)
        times["copy"].append(time.perf_counter() - started)
        times["save_load"].append(save_load(weights))
        log(
            f"weight sync {name} #{version}: vLLM {times['vllm'][-1]:.2f} s, in-process copy "
            f"{times['copy'][-1]:.3f} s, torch.save/load {times['save_load'][-1]:.2f} s"
        )
    gap = logprob_gap(engine, copier.model, vocab_size)
    return SyncFigures(
        name,
        parameters,
        nbytes,
        sum(t.nbytes for _, t in weights),
        statistics.median(times["vllm"]),
        statistics.median(times["copy"]),
        statistics.median(times["save_load"]),
        gap,
        unsynced,
        float(engine.last_start_s or math.nan),
    )


def in_process_cfg(cfg: config.TrainerConfig, model_dir: Path) -> config.TrainerConfig:
    """`cfg` for the transformers engine, loading the engine's folder (no random init to wait for)."""
    data = cfg.model_dump()
    data["rollout"]["kind"] = "transformers"
    data["model"].update(source="pvc", path=str(model_dir))
    return config.TrainerConfig.model_validate(data)


# Every engine this bench started: `main` stops those still up however it ends (an engine's vLLM
# processes outlive a killed parent, and an orphaned EngineCore ignored SIGTERM here).
STARTED: list[Any] = []


def start_engine(cfg: config.TrainerConfig, model_dir: Path, name: str, log: Any) -> Any:
    from rljob_trainer.engines import vllm_engine

    engine = vllm_engine.VLLMEngine(cfg, name=name, colocated=False, model_path=str(model_dir))
    STARTED.append(engine)
    engine.load()
    log(f"engine {name}: vLLM started in {engine.last_start_s:.1f} s")
    return engine


# ---- main ------------------------------------------------------------------------------------------
def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min), {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    # A SIGTERM unwinds through `finally` (the engines are stopped) instead of ending the process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return bench(argv)
    finally:
        for engine in STARTED:
            engine.shutdown()  # a no-op for those stopped already


def bench(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="a smaller step, one A B B A round, one sync per path"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of each vLLM worker and of this process"
    )
    p.add_argument(
        "--model-dir", default=None, help="a Hugging Face folder to bench instead of the geometries"
    )
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    # Inherited by the engines' worker processes (VLLMEngine leaves their threads unbound on CPU).
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    print(load())
    print(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    out: dict[str, Any] = {"threads": args.threads, "quick": args.quick, "load_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="rljob-bench-engine-") as tmp:
        work = Path(tmp)
        if args.model_dir:
            main_dir = Path(args.model_dir)
            main_name = main_dir.name
            main_config = json.loads((main_dir / "config.json").read_text())
            main_model = load_model(main_dir)
            sizes: list[tuple[str, dict[str, Any]]] = [(main_name, main_config)]
        else:
            main_name, main_config = "smollm2-135m", SMOLLM2_135M
            main_dir = work / main_name
            main_model = write_model(main_config, main_dir)
            sizes = [(main_name, main_config), ("smollm2-360m", SMOLLM2_360M)]
        cfg, plan = rendered_config(main_config, quick=args.quick)
        plan_seqs, plan_tokens = vllm_resolved(cfg, str(main_dir), drop_scheduler=False)
        def_seqs, def_tokens = vllm_resolved(cfg, str(main_dir), drop_scheduler=True)
        reserve, available = vllm_default_kv_bytes(cfg)
        print(
            f"plan ({main_name}, {cfg.grpo.prompts_per_step} prompts x {cfg.grpo.group_size}, up to "
            f"{cfg.lengths.max_response_tokens} tokens): max_num_seqs {plan.max_num_seqs}, "
            f"max_num_batched_tokens {plan.max_num_batched_tokens}, "
            f"KV {cfg.rollout.cpu_kv_cache_bytes / GIB:.3f} GiB (vLLM resolves {plan_seqs} / {plan_tokens}); "
            f"vLLM's defaults: max_num_seqs {def_seqs}, "
            f"max_num_batched_tokens {def_tokens}"
        )
        print(
            f"vLLM's default KV sizing on CPU would reserve {reserve / GIB:.1f} GiB "
            f"(gpu_memory_utilization {cfg.rollout.gpu_memory_utilization} x the host's memory; "
            f"{available / GIB:.1f} GiB available now): both engines get the plan's bytes"
        )
        plan_engine = start_engine(cfg, main_dir, "plan", print)
        default_engine = start_engine(with_scheduler(cfg, def_seqs, def_tokens), main_dir, "defaults", print)
        engines = {"plan": plan_engine, "defaults": default_engine}
        work_step = step_workload(cfg, int(main_config["vocab_size"]))
        for side, engine in engines.items():  # the first forward pays one-off set-up
            warm = timed_generate(engine, work_step, side)
            print(f"warm-up {side}: {warm.generated_tokens} tokens in {warm.seconds:.1f} s")
        order = ["plan", "defaults", "defaults", "plan"]
        if not args.quick:
            order += ["defaults", "plan", "plan", "defaults"]
        calls = []
        for side in order:
            calls.append(timed_generate(engines[side], work_step, side))
            c = calls[-1]
            print(
                f"{side}: {c.generated_tokens} tokens in {c.seconds:.2f} s "
                f"({c.generated_tokens / c.seconds:.0f} tokens/s; {c.prompt_tokens} prompt tokens)"
            )
        plan_tps, default_tps = tokens_per_s(calls, "plan"), tokens_per_s(calls, "defaults")
        pairs = paired_ratios(calls)
        ratio = plan_tps / default_tps
        print(
            f"generation: plan {plan_tps:.0f} tokens/s, defaults {default_tps:.0f} tokens/s, "
            f"ratio {ratio:.3f} (neighbouring pairs {min(pairs):.3f}-{max(pairs):.3f})"
        )
        out["generation"] = {
            "plan": {
                "max_num_seqs": plan_seqs,
                "max_num_batched_tokens": plan_tokens,
                "tokens_per_s": plan_tps,
            },
            "defaults": {
                "max_num_seqs": def_seqs,
                "max_num_batched_tokens": def_tokens,
                "tokens_per_s": default_tps,
            },
            "kv_cache_bytes": cfg.rollout.cpu_kv_cache_bytes,
            "ratio": ratio,
            "paired_ratios": pairs,
            "calls": [asdict(c) for c in calls],
            "engine_start_s": {k: e.last_start_s for k, e in engines.items()},
        }
        default_engine.shutdown()  # at most two engines up at once; the syncs need one
        syncs = []
        repeats = 1 if args.quick else 3
        for name, model_config in sizes:
            if name == main_name:  # the plan's engine, up already
                size_cfg, engine, model, model_dir = cfg, plan_engine, main_model, main_dir
            else:
                size_cfg, _ = rendered_config(model_config, quick=True)
                model_dir = work / name
                model = write_model(model_config, model_dir)
                engine = start_engine(size_cfg, model_dir, name, print)
            syncs.append(measure_sync(name, model, model_dir, size_cfg, engine, repeats=repeats, log=print))
            engine.shutdown()
            del model
            s = syncs[-1]
            print(
                f"weight sync {name} ({s.parameters / 1e6:.1f}M parameters, "
                f"{s.weight_bytes / MB:.0f} MB bf16, {s.sent_bytes / MB:.0f} MB sent): "
                f"vLLM fallback {s.vllm_s:.2f} s ({s.vllm_s_per_100mb:.2f} s per 100 MB), in-process copy "
                f"{s.copy_s:.3f} s (x{s.vllm_s / s.copy_s:.1f}), torch.save/load {s.save_load_s:.2f} s "
                f"(x{s.vllm_s / s.save_load_s:.1f}); the engine's log-probs against the new weights' "
                f"max |diff| {s.logprob_max_abs_diff:.3f} after the sync, "
                f"{s.logprob_max_abs_diff_unsynced:.3f} before it"
            )
            if not s.logprob_max_abs_diff < s.logprob_max_abs_diff_unsynced / 4:
                print(
                    f"WARNING: {name}: the engine's log-probs are not the new weights': did the sync arrive?"
                )
        out["weight_sync"] = [{**asdict(s), "vllm_s_per_100mb": s.vllm_s_per_100mb} for s in syncs]
    out["load_end"] = os.getloadavg()
    print(load())
    if args.json:
        print(json.dumps(out))
    big = max(syncs, key=lambda s: s.weight_bytes)
    print(
        f"engine: plan {plan_tps:.0f} tokens/s, vLLM defaults {default_tps:.0f} tokens/s, ratio {ratio:.2f}; "
        f"weight sync {big.vllm_s_per_100mb:.2f} s per 100 MB, {big.vllm_s / big.copy_s:.1f} x an in-process "
        f"copy, {big.vllm_s / big.save_load_s:.1f} x torch.save/load"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
