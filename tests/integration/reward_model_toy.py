"""A tiny reward model trained on preferences for the toy task: the reward-model judge's tests' and
bench's judge.

A random reward model scores noise, so a job judged by it can show the path but never that a
reward model's judgement reaches the policy. This builds (once, cached under $RLJOB_MODEL_CACHE or
~/.cache/rljob/models, keyed by this file's recipe) a Llama sequence-classifier of 2 layers and heads
of 32 (what vLLM's CPU attention takes) over the character tokenizer and its chat template, trained
as reward models are (TRL's RewardTrainer: the Bradley-Terry loss, -log sigmoid(r_chosen -
r_rejected)) on pairs of the toy task (`data.builtin` toy-arithmetic, "a+b=" with a one-digit sum):
for each prompt, its right answer preferred over every other answer the toy policy can write (a
wrong digit, a symbol, nothing). It scores a conversation the way the judge sends it
(`judge.conversation_ids`: the prompt as the user's turn, the answer as the assistant's), at the
last token (`engines.reward_model`). It is a folder like any `model.source: pvc` reward model
(config, safetensors, tokenizer with its template). It knows the 55 prompts it was trained on and
nothing else: it stands for a reward model, it is not one of general use.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

RECIPE = {"hidden": 64, "heads": 2, "layers": 2, "steps": 800, "batch": 64, "lr": 3e-3, "seed": 11}
#: What the toy policy's one token decodes to (builtin-digits), wrong ones among them.
ANSWERS = [*"0123456789", "+", "-", "*", "=", "#", ""]


def _key() -> str:
    return hashlib.sha256(json.dumps({**RECIPE, "answers": ANSWERS}, sort_keys=True).encode()).hexdigest()[
        :12
    ]


def cache_dir() -> Path:
    root = Path(os.environ.get("RLJOB_MODEL_CACHE") or Path.home() / ".cache" / "rljob" / "models")
    return root / f"test-toy-reward-model-{_key()}"


def tasks() -> list[tuple[str, str]]:
    """The toy task's (prompt, answer) pairs, as the trainer reads them."""
    from rljob_trainer import config
    from rljob_trainer.data import sources

    return [
        (e.prompt, e.answer) for e in sources.load_examples(config.DataSettings(builtin="toy-arithmetic"))
    ]


def pairs() -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): the right answer over every other one."""
    return [(p, a, wrong) for p, a in tasks() for wrong in ANSWERS if wrong != a]


def model_settings(path: Path, **over: Any) -> dict[str, Any]:
    """`model` of a judge that loads the folder."""
    return {
        "name": "toy-reward-model",
        "source": "pvc",
        "path": str(path),
        "tokenizer": "auto",
        "dtype": "float32",
        **over,
    }


def build(out: Path | None = None) -> Path:
    """The model's folder (built once; a build in progress is never taken for a finished one)."""
    out = out or cache_dir()
    if (out / "config.json").exists() and (out / "recipe.json").exists():
        return out
    import torch

    from rljob_trainer import config
    from rljob_trainer.data import judge
    from rljob_trainer.engines import reward_model
    from rljob_trainer.model import modeling

    tok = modeling.build_char_tokenizer(modeling.CHARSETS["builtin-char"])
    tok.chat_template = modeling.CHAR_CHAT_TEMPLATE
    hf = modeling.tiny_hf_config(
        len(tok),
        model_type="llama",
        hidden_size=RECIPE["hidden"],
        num_attention_heads=RECIPE["heads"],
        num_hidden_layers=RECIPE["layers"],
    )
    hf["pad_token_id"] = tok.pad_token_id
    settings = config.ModelSettings(
        name="toy-rm", source="tiny", hf_config=hf, tokenizer="builtin-char", dtype="float32"
    )
    model = modeling.build_reward_model(settings, init_seed=RECIPE["seed"]).train()
    data = [(judge.conversation_ids(tok, p, c), judge.conversation_ids(tok, p, r)) for p, c, r in pairs()]
    rng = random.Random(RECIPE["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["lr"])

    def scores(seqs: list[list[int]]) -> torch.Tensor:
        return reward_model.last_token_scores(model, seqs, tok.pad_token_id)  # as the engine scores

    for _ in range(RECIPE["steps"]):
        batch = rng.sample(data, RECIPE["batch"])
        margin = scores([c for c, _ in batch]) - scores([r for _, r in batch])
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        right = sum(int(m > 0) for m in scores([c for c, _ in data]) - scores([r for _, r in data]))
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps({**RECIPE, "pairs": len(data), "pairs_ranked_right": right}))
    tmp.rename(out)
    return out


if __name__ == "__main__":
    folder = build()
    print(folder, (folder / "recipe.json").read_text())
