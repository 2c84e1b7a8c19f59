"""scripts/plot_curves.py draws a run's curves from its own TensorBoard event files (written here by
the same SummaryWriter the trainer's tracker uses)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("plot_curves", REPO / "scripts" / "plot_curves.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.torch
def test_the_picture_is_drawn_from_the_runs_own_scalars(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from torch.utils.tensorboard import SummaryWriter

    plot_curves = _module()
    writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
    writer.add_scalar("eval/mean_reward", 0.19, 0)  # before training
    for step, reward in enumerate([0.06, 0.09, 0.12, 0.2, 0.25], start=1):
        writer.add_scalar("mean_reward", reward, step)
    writer.add_scalar("eval/mean_reward", 0.31, 5)
    writer.close()
    scalars = plot_curves.read_scalars(tmp_path / "tb")
    assert scalars["eval/mean_reward"] == [(0, pytest.approx(0.19)), (5, pytest.approx(0.31))]
    assert [s for s, _ in scalars["mean_reward"]] == [1, 2, 3, 4, 5]
    assert plot_curves.main([str(tmp_path / "tb"), str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_eval_scalars_is_refused_naming_the_tags(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot_curves = _module()
    with pytest.raises(SystemExit, match=r"no scalars \['eval/mean_reward'\]"):
        plot_curves.plot({"mean_reward": [(1, 0.1)]}, tmp_path / "x.png", "")
