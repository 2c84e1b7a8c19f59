"""A tiny Llama that has learned to call the calculator: the agent tests' and the bench's policy.

A random tiny model almost never writes a well-formed `<tool_call>`, so the agent loop's real-engine
tests would only ever see one-turn episodes. This builds (once, cached under
$RLJOB_MODEL_CACHE or ~/.cache/rljob/models, keyed by this file's recipe) a Llama of 2 layers, heads
of 32 (what vLLM's CPU attention takes), taught by supervised steps on a character tokenizer to
answer "What is A+B?" with `<tool_call>{"name": "calc", "arguments": {"expression": "A+B"}}</tool_call>`
and, once the tool's message is in its context, with the number it read there. Its chat template
offers the tools in one line (`tools: calc(expression)`) so prompts stay short. It is a folder like
any `model.source: pvc` model (config, safetensors, tokenizer with its template): the trainer and
vLLM load it as they load SmolLM2. How well it learned does not matter to the tests (they check the
loop, the tokens and the log-probs, never the answers); it calls the tool nearly always.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

TEMPLATE = (
    "{%- if tools %}tools: {% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters.properties | list | join(',') }}) {% endfor %}\n{% endif %}"
    "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)
RECIPE = {
    "hidden": 128,
    "heads": 4,
    "kv_heads": 2,
    "layers": 2,
    "steps": 300,
    "batch": 16,
    "lr": 3e-3,
    "arch": "llama",
}
TOOL = {"name": "calc", "kind": "calculator", "description": "Add."}


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def _key() -> str:
    return hashlib.sha256((json.dumps(RECIPE, sort_keys=True) + TEMPLATE).encode()).hexdigest()[:12]


def cache_dir() -> Path:
    root = Path(os.environ.get("RLJOB_MODEL_CACHE") or Path.home() / ".cache" / "rljob" / "models")
    return root / f"test-agent-calc-{_key()}"


def build(out: Path | None = None) -> Path:
    """The model's folder (built once; a build in progress is never taken for a finished one)."""
    out = out or cache_dir()
    if (out / "config.json").exists() and (out / "recipe.json").exists():
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rljob_trainer import config
    from rljob_trainer.model import modeling
    from rljob_trainer.rollout import agent, tools

    tok = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
    tok.chat_template = TEMPLATE
    fmt = agent.ChatFormat(tok, tools.tool_schemas([config.ToolSettings(**TOOL)]))
    assert not fmt.system_tools  # the template offers the tools itself

    def episode(a: int, b: int) -> tuple[list[int], list[int]]:
        prompt = fmt.prompt_ids(question(a, b))
        call = tools.format_tool_call(tools.ToolCall("calc", {"expression": f"{a}+{b}"}))
        turn1 = [*tok.encode(call, add_special_tokens=False), tok.eos_token_id]
        obs = fmt.observation_ids(
            agent.tool_messages([tools.ToolResult("calc", str(a + b), True)]), turn_ended_with_eos=True
        )
        turn2 = [*tok.encode(str(a + b), add_special_tokens=False), tok.eos_token_id]
        ids = prompt + turn1 + obs + turn2
        mask = [0] * len(prompt) + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
        return ids, mask

    r = RECIPE
    hf = modeling.tiny_hf_config(
        len(tok),
        hidden_size=r["hidden"],
        num_attention_heads=r["heads"],
        num_key_value_heads=r["kv_heads"],
        num_hidden_layers=r["layers"],
        intermediate_size=2 * r["hidden"],
        max_position_embeddings=512,
        # Llama, not Qwen2: transformers 5 loads a Qwen2 folder's tokenizer as Qwen2Tokenizer, whatever
        # tokenizer_config.json says, and that one drops this character tokenizer's spaces.
        model_type=r["arch"],
    )
    hf.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    model_type = hf.pop("model_type")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf), dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=r["lr"])
        rng = random.Random(0)
        for _ in range(r["steps"]):
            batch = [episode(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(r["batch"])]
            width = max(len(ids) for ids, _ in batch)
            x = torch.full((len(batch), width), tok.pad_token_id)
            m = torch.zeros(len(batch), width)
            for k, (ids, mask) in enumerate(batch):
                x[k, : len(ids)] = torch.tensor(ids)
                m[k, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
            logits = model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
            )
            loss = (loss * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps({**RECIPE, "final_loss": float(loss)}))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: its folder is as good
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_settings(path: Path, **over: Any) -> dict[str, Any]:
    """`model` of a trainer config that loads the folder (full fine-tuning, float32)."""
    return {
        "name": "tiny-agent-calc",
        "source": "pvc",
        "path": str(path),
        "tokenizer": "auto",
        "dtype": "float32",
        "finetune": "full",
        **over,
    }


if __name__ == "__main__":
    print(build())
