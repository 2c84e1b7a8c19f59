"""A run's reward and held-out evaluation curves as a picture, from its own TensorBoard scalars.

Reads the event files every RLJob writes (`<checkpoint>/tensorboard`, or `tracking.tensorboardDir`)
with TensorBoard's own reader and draws two panels with matplotlib: the training reward per step
(`mean_reward`) and the held-out evaluation (`eval/mean_reward`, step 0 = before training). Nothing
else goes into the picture: what it shows is what the run logged. docs/outputs.md shows one.
    .venv/bin/python scripts/plot_curves.py RUN/tensorboard docs/images/smollm2-reasoning.png [--title T]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TRAIN_TAG = "mean_reward"
EVAL_TAG = "eval/mean_reward"


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in `logdir`'s event files (a step's last value wins)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for tag in acc.Tags().get("scalars", []):
        by_step = {e.step: e.value for e in acc.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def plot(scalars: dict[str, list[tuple[int, float]]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    missing = [t for t in (TRAIN_TAG, EVAL_TAG) if t not in scalars]
    if missing:
        raise SystemExit(f"no scalars {missing} in the event files (tags there: {sorted(scalars)[:12]})")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
    steps, values = zip(*scalars[TRAIN_TAG], strict=True)
    left.plot(steps, values, color="#1f77b4", linewidth=1.2, marker=".")
    left.set(title="training reward (mean over the step's samples)", xlabel="step", ylabel="reward")
    steps, values = zip(*scalars[EVAL_TAG], strict=True)
    right.plot(steps, values, color="#d62728", linewidth=1.6, marker="o")
    for s, v in zip(steps, values, strict=True):
        right.annotate(f"{v:.3f}", (s, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    right.set(title="held-out accuracy (greedy; step 0 = before training)", xlabel="step", ylabel="accuracy")
    from matplotlib.ticker import MaxNLocator

    for ax in (left, right):
        ax.grid(alpha=0.3)
        top = max(line.get_ydata().max() for line in ax.get_lines())
        ax.set_ylim(0, max(top * 1.3, 0.05))  # room for the value labels under the title
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logdir", type=Path, help="the run's TensorBoard folder")
    p.add_argument("out", type=Path, help="the picture to write (.png or .svg)")
    p.add_argument("--title", default="", help="a line above both panels")
    args = p.parse_args(argv)
    scalars = read_scalars(args.logdir)
    plot(scalars, args.out, args.title)
    last = scalars[EVAL_TAG]
    print(
        f"{args.out}: eval {last[0][1]:.3f} at step {last[0][0]} -> {last[-1][1]:.3f} at step {last[-1][0]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
