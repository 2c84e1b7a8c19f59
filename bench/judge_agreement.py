"""How well a judge model judges: the share of its answers `parse_score` can read, and how often its
verdict agrees with the truth, on reasoning-gym answers known to be right or wrong.

The judge, its prompt template, maxScore and maxTokens come from an example's `spec.reward.judge`
(default examples/smollm2-agent.yaml: SmolLM2-135M-Instruct judging chain_sum); `--template` adds
other templates to compare with it. Each item is a question of the example's training task and a
student's answer, right for even items and off by a small amount for odd ones, written as the policy
writes them ("The sum is N. <answer>N</answer>"). The judge sees what the trainer's judge sends: the
template rendered (`render_prompt`) inside the judge's chat template (`prompt_ids`), and
answers greedily within maxTokens (transformers' `generate`, fp32: the same model as vLLM serves,
not its kernels). A verdict is the parsed score >= half of maxScore; an unparsed answer agrees with
nothing (the trainer scores it 0).

Prints one line per template: `judge_agreement: <name> parsed P/N agreed A/N (<seconds> s)` and the
first answers. Chance is N/2 agreed.
    .venv/bin/python bench/judge_agreement.py [--items 24] [--template NAME=TEXT:MAXSCORE ...]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "smollm2-agent.yaml"


def items(spec: dict[str, Any], n: int, seed: int) -> list[tuple[str, str, str, bool]]:
    """(question, correct answer, student's answer, whether it is right), half right."""
    import reasoning_gym

    task = spec["data"]["source"]["reasoningGym"]
    data = reasoning_gym.create_dataset(task["task"], **task.get("config", {}), size=n, seed=seed)
    rng = random.Random(seed)
    out = []
    for i, entry in enumerate(data):
        right = i % 2 == 0
        said = entry["answer"] if right else str(int(entry["answer"]) + rng.choice([-11, -3, 2, 7, 10]))
        out.append((entry["question"], entry["answer"], f"The sum is {said}. <answer>{said}</answer>", right))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--example", type=Path, default=EXAMPLE)
    ap.add_argument("--items", type=int, default=24)
    ap.add_argument("--seed", type=int, default=5, help="reasoning-gym seed (not the example's data seeds)")
    ap.add_argument("--template", action="append", default=[], help="NAME=TEXT:MAXSCORE, also judged")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljob_trainer.data.judge import parse_score, prompt_ids, render_prompt
    from rljob_trainer.model import packaged

    spec = yaml.safe_load(args.example.read_text())["spec"]
    judge = spec["reward"]["judge"]
    templates = {"example": (judge["promptTemplate"], float(judge.get("maxScore", 1)))}
    for t in args.template:
        name, _, rest = t.partition("=")
        text, _, max_score = rest.rpartition(":")
        templates[name] = (text.replace("\\n", "\n"), float(max_score))
    model_dir = packaged.ensure("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cases = items(spec, args.items, args.seed)
    for name, (template, max_score) in templates.items():
        t0, parsed, agreed, answers = time.perf_counter(), 0, 0, []
        for question, answer, response, right in cases:
            text = render_prompt(
                template, prompt=question, response=response, answer=answer, max_score=max_score
            )
            ids = torch.tensor([prompt_ids(tok, text)])
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=int(judge.get("maxTokens", 8)), do_sample=False)
            reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            answers.append(reply)
            score = parse_score(reply, max_score)
            parsed += score is not None
            agreed += score is not None and (score >= 0.5) == right
        n = len(cases)
        print(f"  {name} answered e.g. {answers[:3]}")
        print(
            f"judge_agreement: {name} parsed {parsed}/{n} agreed {agreed}/{n} "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
