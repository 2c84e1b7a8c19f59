"""Transformers rollout engine: the CPU (and test) implementation of `base.RolloutEngine`.

Role: generate completions with a plain Hugging Face causal LM, a KV cache and a per-request seeded
sampler (so a request's output does not depend on the batch it shares), returning the log-probs it
sampled with (`rljob_trainer.model.sampling`: vLLM 0.33's `processed_logprobs`, temperature then top-p,
greedy below temperature 1e-5; the trainer computes the same); sleep and take new
weights in place under vLLM's rules (`base.SleepState`: level 1 offloads, level 2 discards, no
update while the weights sleep, no sleep without sleep mode), so a driver that breaks them on a GPU
breaks here too. With `rollout.engineLora` (model.finetune lora) it serves the policy as vLLM's
LoRA engines do: the base model plus the same PEFT adapter, so a weight sync sends only the adapter
(names in PEFT's saved-adapter form), or base and adapter after a level-2 sleep. Partial rollouts
follow vLLM's pause rules (`base.PauseState`): `interrupt()` (from another thread: the Ray actor's
control group) stops a running generate call before its next token and pauses the engine, whose
weights may then be updated, never while a call runs.
Callers: `rljob_trainer.engines.build_engine` (inside a Ray actor or in-process), tests.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from rljob_trainer import config as config_mod
from rljob_trainer.engines import base
from rljob_trainer.model import modeling, precision
from rljob_trainer.model import sampling as rljob_sampling


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5.x renamed `past_key_values` to `cache` (the old name warns); 4.x has only the old.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    return out.cache if hasattr(out, "cache") else out.past_key_values


class TransformersEngine(base.RolloutEngine):
    """A CPU engine that obeys vLLM's sleep, weight and pause rules (`base.SleepState`, `base.PauseState`).

    `colocated` engines with `rollout.enableSleepMode` can sleep; others refuse, as a vLLM engine
    built without `enable_sleep_mode` does. Level 1 keeps a host copy of the weights, level 2
    discards them (wake(tags=["weights"]) reallocates garbage that update_weights() must overwrite).
    """

    def __init__(
        self,
        cfg: config_mod.TrainerConfig,
        *,
        name: str,
        colocated: bool,
        device: str = "cpu",
        torch_threads: int | None = None,
        tp_workers_in_placement_group: bool = False,
    ) -> None:
        del tp_workers_in_placement_group  # one process here; vLLM spreads TP workers (vllm_engine)
        self.name = name
        self.colocated = colocated
        self._cfg = cfg
        self._device = torch.device(device)
        self._torch_threads = torch_threads
        self._model: torch.nn.Module | None = None
        self._offloaded: dict[str, torch.Tensor] | None = None
        self._shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._missing: set[str] = set()
        self._state = base.SleepState(name, sleep_enabled=colocated and cfg.rollout.enable_sleep_mode)
        self._pause = base.PauseState(name)
        self.serves_lora = cfg.rollout.engine_lora and cfg.model.finetune == "lora"
        self._version = 0
        self._served = 0
        self._tokens = 0
        tok = modeling.load_tokenizer(cfg.model)
        self._pad_id = int(tok.pad_token_id)
        self._eos_id = int(tok.eos_token_id)

    # ---- lifecycle -------------------------------------------------------------------------------
    def load(self) -> None:
        if self._model is not None:
            return
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
        model = modeling.build_base_model(
            self._cfg.model, init_seed=self._cfg.grpo.seed, attn_implementation="sdpa"
        )
        if self.serves_lora:  # the trainer's adapter shape; B starts at zero, so it serves the base
            model = modeling.apply_finetune_mode(model, self._cfg.model)
            model.requires_grad_(False)
            # vLLM holds LoRA weights in the model dtype (peft would upcast them to fp32).
            precision.cast_params_(model, precision.compute_dtype(self._cfg.model.dtype))
        self._model = model.to(self._device).eval()

    @property
    def model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError(f"engine {self.name}: load() has not been called")
        return self._model

    @property
    def is_sleeping(self) -> bool:
        return not self._state.fully_awake

    @property
    def sleep_state(self) -> base.SleepState:
        return self._state

    @property
    def weights_version(self) -> int:
        return self._version

    def sleep(self, level: int = 1) -> None:
        if self.is_sleeping:
            return
        self._state.on_sleep(level)
        # Move every parameter's storage out of the model: level 1 keeps a host copy (vLLM offloads
        # weights to CPU memory), level 2 keeps nothing. The KV cache lives only inside generate().
        offloaded: dict[str, torch.Tensor] = {}
        for n, p in self.model.named_parameters():
            self._shapes[n] = (p.shape, p.dtype)
            if level == 1:
                offloaded[n] = p.data.to("cpu", copy=True)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._offloaded = offloaded

    def wake(self, tags: Sequence[str] | None = None) -> None:
        new = self._state.on_wake(tags)
        if "weights" not in new or self._offloaded is None:
            return
        for n, p in self.model.named_parameters():
            if n in self._offloaded:
                p.data = self._offloaded[n].to(self._device)
            else:  # level 2: fresh memory with undefined contents, as vLLM reallocates it
                shape, dtype = self._shapes[n]
                p.data = torch.full(shape, float("nan"), dtype=dtype, device=self._device)
        self._missing = {n for n, _ in self.model.named_parameters()} - set(self._offloaded)
        self._offloaded = None

    supports_partial_rollouts = True

    @property
    def pause_state(self) -> base.PauseState:
        return self._pause

    def interrupt(self) -> None:
        self._pause.pause(self._cfg.rollout.engine_timeout_s)

    def resume(self) -> None:
        self._pause.resume()

    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        self._state.check_update()
        self._pause.check_update()
        items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        if self.serves_lora:
            return self._update_lora(items, version)
        state = self.model.state_dict()
        unknown = sorted(set(items) - set(state))
        if unknown:
            raise ValueError(f"engine {self.name}: unknown weight names {unknown[:5]}")
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            buffers = dict(self.model.named_buffers())
            for k, v in items.items():
                target = params.get(k, buffers.get(k))
                if target is None:  # a tied alias (lm_head.weight) already covered by its owner
                    continue
                target.copy_(torch.as_tensor(v).to(target.dtype))
                self._missing.discard(k)
        if not self._missing:
            self._state.weights_valid = True
        self._version = self._version + 1 if version is None else int(version)
        return len(items)

    def _lora_targets(self) -> dict[str, tuple[str, torch.Tensor]]:
        """Sync name -> (parameter name, live tensor): base tensors in the base model's naming (as
        `weight_sync.lora_base_and_adapter_tensors` sends them), adapter tensors in PEFT's saved form."""
        from peft import get_peft_model_state_dict

        live = self.model.state_dict(keep_vars=True)
        name_of = {id(t): n for n, t in live.items()}
        targets = {
            n.removeprefix("base_model.model.").replace(".base_layer.", "."): (n, t)
            for n, t in live.items()
            if "lora_" not in n
        }
        for key, t in get_peft_model_state_dict(self.model, state_dict=live).items():
            targets[key] = (name_of[id(t)], t)
        return targets

    def _update_lora(self, items: dict[str, Any], version: int | None) -> int:
        targets = self._lora_targets()
        unknown = sorted(set(items) - set(targets))
        if unknown:
            raise ValueError(f"engine {self.name}: unknown weight names {unknown[:5]} (it serves LoRA)")
        with torch.no_grad():
            for k, v in items.items():
                name, target = targets[k]
                target.copy_(torch.as_tensor(v).to(target.dtype))
                self._missing.discard(name)
        if not self._missing:
            self._state.weights_valid = True
        self._version = self._version + 1 if version is None else int(version)
        return len(items)

    def adapter_version(self) -> int | None:
        """The weights version of the LoRA adapter this engine serves (None: it serves none, or its
        weights were discarded by a level-2 sleep). Its adapter lives in the model, so unlike vLLM's
        (issue 53888) a level-1 sleep never loses it; the driver asks both engines the same way."""
        if not self.serves_lora or not self._state.weights_valid:
            return None
        return self._version

    def load_report(self) -> base.EngineLoad:
        return base.EngineLoad(self.name, self.is_sleeping, self._served, self._tokens)

    # ---- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        self._state.check_generate()
        n = len(prompts_token_ids)
        if n == 0:
            return []
        meta = {"engine": self.name, "version": self._version}
        return self._pause.run_generate(
            prompts_token_ids, meta, lambda: self._generate(prompts_token_ids, sampling)
        )

    def _generate(
        self, prompts_token_ids: Sequence[Sequence[int]], sampling: base.SamplingSettings
    ) -> list[base.GenerationOutput]:
        n = len(prompts_token_ids)
        seeds = sampling.seeds if sampling.seeds is not None else tuple(range(n))
        if len(seeds) != n:
            raise ValueError(f"{len(seeds)} seeds for {n} prompts")
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        stop = {*sampling.stop_token_ids, *(() if sampling.ignore_eos else (self._eos_id,))}
        model = self.model
        max_len = max(len(p) for p in prompts_token_ids)
        ids = torch.full((n, max_len), self._pad_id, dtype=torch.long)
        attn = torch.zeros((n, max_len), dtype=torch.long)
        for i, p in enumerate(prompts_token_ids):  # left padding: every row ends at its prompt's end
            ids[i, max_len - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attn[i, max_len - len(p) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        started = time.perf_counter()
        out = model(
            input_ids=ids.to(self._device),
            attention_mask=attn.to(self._device),
            position_ids=pos.to(self._device),
            use_cache=True,
        )
        prefilled = time.perf_counter()
        cache_kw = _cache_kwarg(model)
        past = _cache_of(out)
        logits = out.logits[:, -1, :].float().cpu()
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        budgets = [sampling.budget(i) for i in range(n)]
        done = [b <= 0 for b in budgets]
        reasons = ["length"] * n
        next_pos = pos[:, -1:] + 1
        greedy = rljob_sampling.is_greedy(sampling.temperature)
        for _ in range(max(budgets)):
            if self._pause.should_stop():  # interrupted: the unfinished requests return what they have
                reasons = [r if d else base.ABORTED for r, d in zip(reasons, done, strict=True)]
                break
            # What it samples from and returns: vLLM's processed log-probs (temperature, then top-p).
            logp = rljob_sampling.processed_log_probs(
                logits, temperature=sampling.temperature, top_p=sampling.top_p
            )
            nxt = torch.full((n,), self._pad_id, dtype=torch.long)
            for i in range(n):
                if done[i]:
                    continue
                if greedy:
                    tok = int(torch.argmax(logp[i]).item())
                else:
                    tok = int(torch.multinomial(logp[i].exp(), 1, generator=gens[i]).item())
                tokens[i].append(tok)
                lps[i].append(float(logp[i, tok]))
                nxt[i] = tok
                if tok in stop:
                    done[i], reasons[i] = True, "stop"
                elif len(tokens[i]) >= budgets[i]:
                    done[i] = True
            if all(done):
                break
            attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], dim=1)
            out = model(
                input_ids=nxt[:, None].to(self._device),
                attention_mask=attn.to(self._device),
                position_ids=next_pos.to(self._device),
                use_cache=True,
                **{cache_kw: past},
            )
            past = _cache_of(out)
            logits = out.logits[:, -1, :].float().cpu()
            next_pos = next_pos + 1
        self._served += n
        self._tokens += sum(len(t) for t in tokens)
        v = self._version
        # Each request's share of the call's engine-seconds (what a refit of the estimator reads).
        timing = {"prefill_s": (prefilled - started) / n, "decode_s": (time.perf_counter() - prefilled) / n}
        return [
            base.GenerationOutput(
                tuple(p),
                tuple(t),
                tuple(lp),
                r,
                {"engine": self.name, "version": v},
                (v,) * len(t),
                dict(timing),
            )
            for p, t, lp, r in zip(prompts_token_ids, tokens, lps, reasons, strict=True)
        ]
