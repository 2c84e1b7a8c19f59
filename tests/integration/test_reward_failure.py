"""A reward module that raises fails the step, and the trainer's termination message names the
module, the function and the exception (what `kubectl describe pod` shows for the container)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from trainer_configs import toy_config

from rljob_trainer import config

pytestmark = [pytest.mark.torch]


def test_a_raising_reward_module_is_named_in_the_termination_message(tmp_path):
    module = tmp_path / "team_reward.py"
    module.write_text(
        "def judge(prompts, completions, answers, **kwargs):\n"
        "    raise ZeroDivisionError('the judge divided by zero')\n"
    )
    cfg = toy_config(
        grpo={"maxSteps": 1, "promptsPerStep": 2},
        rollout={"sharedEngines": 1, "dedicatedEngines": 0},
        distributed={"numTrainerRanks": 1, "launcher": "local"},
        rewards=[{"name": "module", "path": str(module), "function": "judge"}],
    )
    cfg_path = tmp_path / "trainer.json"
    cfg_path.write_text(config.dump_config(cfg))
    termination = tmp_path / "termination-log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")}
    env["RLJOB_TERMINATION_LOG"] = str(termination)
    proc = subprocess.run(
        [sys.executable, "-m", "rljob_trainer", "--config", str(cfg_path), "--local"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode != 0
    message = termination.read_text()
    assert message.startswith("RewardError: reward ") and f"{module}:judge" in message, message
    assert "ZeroDivisionError: the judge divided by zero" in message, message
