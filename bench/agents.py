"""Agents benchmark: episodes per hour, and the share of an episode's time spent in its tools.

Role: measures the multi-turn loop (`spec.rollout.agent`) end to end. Each run is the real trainer
entry point, `python -m rljob_trainer`, on a private local Ray node: one training rank and one
dedicated engine (the transformers engine, or vLLM's CPU build with `--engine vllm`) as Ray actors,
the driver running the episodes' tool calls on its agent threads. The policy is the tiny Llama that
learned to call a calculator (`tests/integration/agent_model.py`: built once, cached): on "What is
A+B?" it writes a `<tool_call>`, reads the tool's answer and replies with a number, so nearly every
episode has two turns and one tool call.

Three configurations on the same model, task and batch (the two http ones run twice, in the order
sync, async, async, sync, and are pooled):
- `calculator`: the built-in calculator (microseconds): what the loop itself costs;
- `http tool, sync`: the same call served by a user tool over HTTP (a local server that answers
  after `--tool-latency-s`, default 0.25 s), maxStaleness 0: the trainer waits for the episodes,
  their tool time included;
- `http tool, maxStaleness 1`: the same, with generation (episodes, tools and all) running while the
  trainer trains: the tool time that overlap hides.
Figures are over every step but the first (start-up) and the last (nothing left to generate beside
it): episodes/hour = episodes / the steps' wall time; tool time share = seconds episodes spent in
tool calls / the episodes' wall time (from their first turn to their end); steps/hour; the trainer's
wait for rollouts per step. The last line is

    agents: episodes/h C calculator, S http sync, A http maxStaleness 1 (xR), tool time share T

```sh
.venv/bin/python bench/agents.py [--steps 8] [--prompts 4] [--group 4] [--tool-latency-s 0.25] \\
    [--engine transformers|vllm] [--json]
```
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import agent_model  # noqa: E402  (the tests' tool-calling model, built once and cached)

from rljob_trainer.rollout import tools  # noqa: E402


class _ToolServer(http.server.ThreadingHTTPServer):
    latency_s = 0.25


class _ToolHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        time.sleep(self.server.latency_s)  # type: ignore[attr-defined]
        try:
            result = tools.format_number(
                tools.evaluate_arithmetic(str(body["arguments"].get("expression", "")))
            )
        except tools.CalculatorError as e:
            result = f"error: {e}"
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _config(
    model: Path, data: Path, args: argparse.Namespace, *, tool: dict[str, Any], staleness: int
) -> dict[str, Any]:
    rollout: dict[str, Any] = {
        "kind": args.engine,
        "sharedEngines": 0,
        "dedicatedEngines": 1,
        "engineNumCpus": 1,
    }
    if args.engine == "vllm":
        rollout.update(maxNumSeqs=64, maxNumBatchedTokens=1024, cpuKvCacheBytes=128 << 20)
    return {
        "model": agent_model.model_settings(model),
        "lengths": {"maxPromptTokens": 64, "maxResponseTokens": 192},
        "grpo": {
            "groupSize": args.group,
            "promptsPerStep": args.prompts,
            "maxSteps": args.steps,
            "learningRate": 1e-5,
            "temperature": 0.7,
            "maxStaleness": staleness,
            "seed": 5,
        },
        "batching": {"packed": True, "dynamic": True, "maxTokensPerMicroBatch": 4096},
        "rollout": rollout,
        "data": {"path": str(data), "chatTemplate": True},
        "rewards": [{"name": "mathAccuracy"}],
        "telemetry": {"enabled": False, "prometheusPort": None},
        "distributed": {"numTrainerRanks": 1, "launcher": "ray", "torchThreadsPerRank": 1, "rankNumCpus": 1},
        "agent": {"maxTurns": 3, "tools": [tool]},
    }


def _run(name: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    cfg_path, metrics = work / f"{name}.json", work / f"{name}.metrics.jsonl"
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLJOB_")}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rljob_trainer", "--config", str(cfg_path), "--metrics-jsonl", str(metrics)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) > 0]
    timed = rows[1:-1] or rows
    episodes = sum(r["agent/episodes"] for r in timed)
    step_s = sum(r["step_s"] for r in timed)
    wall = sum(r["agent/episode_s_mean"] * r["agent/episodes"] for r in timed)
    wait = sum(r["agent/wait_s"] for r in timed)
    return {
        "run": name,
        "seconds": time.monotonic() - t0,
        "timed_steps": len(timed),
        "episodes_per_h": 3600.0 * episodes / step_s if step_s else 0.0,
        "steps_per_h": 3600.0 * len(timed) / step_s if step_s else 0.0,
        "tool_time_share": wait / wall if wall else 0.0,
        "turns_mean": sum(r["agent/turns_mean"] for r in timed) / len(timed),
        "tool_calls_mean": sum(r["agent/tool_calls_mean"] for r in timed) / len(timed),
        "trainer_wait_s": sum(r["trainer_wait_s"] for r in timed) / len(timed),
        "training_s": sum(r["training_s"] for r in timed) / len(timed),
        "mean_reward": sum(r["mean_reward"] for r in timed) / len(timed),
    }


def _pool(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Two runs of one configuration as one: rates from summed episodes and seconds (a mean of
    rates would weigh the faster run's steps more), shares and means averaged."""
    hours = sum(r["timed_steps"] / r["steps_per_h"] for r in runs if r["steps_per_h"])
    episodes = sum(
        r["episodes_per_h"] * r["timed_steps"] / r["steps_per_h"] for r in runs if r["steps_per_h"]
    )
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if isinstance(runs[0][k], int | float)}
    out["run"] = runs[0]["run"]
    out["episodes_per_h"] = episodes / hours if hours else 0.0
    out["steps_per_h"] = sum(r["timed_steps"] for r in runs) / hours if hours else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--tool-latency-s", type=float, default=0.25)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model = agent_model.build()
    server = _ToolServer(("127.0.0.1", 0), _ToolHandler)
    server.latency_s = args.tool_latency_s
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/call"
    # The calculator's schema (the prompt the model learned on: `calc(expression)`), served over HTTP.
    schema = tools.tool_schema(tools.config_mod.ToolSettings(**agent_model.TOOL))["function"]["parameters"]
    http_tool = {**agent_model.TOOL, "kind": "http", "url": url, "timeoutS": 30, "parameters": schema}
    results = []
    with tempfile.TemporaryDirectory(prefix="rljob-bench-agents-") as tmp:
        work = Path(tmp)
        data = work / "questions.jsonl"
        rows = [
            {"prompt": agent_model.question(a, b), "answer": str(a + b)}
            for a in range(10, 90, 7)
            for b in range(3, 60, 11)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        # sync, async, async, sync: a machine that slows or speeds up over the minutes cancels to
        # first order in the pooled figures (as bench/pipeline.py orders its runs).
        runs = (
            ("calculator", agent_model.TOOL, 0),
            ("http tool, sync", http_tool, 0),
            ("http tool, maxStaleness 1", http_tool, 1),
            ("http tool, maxStaleness 1", http_tool, 1),
            ("http tool, sync", http_tool, 0),
        )
        for k, (name, tool, staleness) in enumerate(runs):
            res = _run(
                f"run{k}",  # its own config and metrics files (the driver appends to its metrics file)
                _config(model, data, args, tool=tool, staleness=staleness),
                work,
            )
            res["run"] = name
            results.append(res)
            if not args.json:
                r = res
                print(
                    f"{name:>26}: episodes/h {r['episodes_per_h']:7.0f}, steps/h {r['steps_per_h']:6.0f}, "
                    f"tool time share {r['tool_time_share']:.2f}, turns {r['turns_mean']:.2f}, "
                    f"tool calls {r['tool_calls_mean']:.2f}, trainer wait {r['trainer_wait_s']:.2f} s/step, "
                    f"training {r['training_s']:.2f} s/step ({r['seconds']:.0f} s run)",
                    flush=True,
                )
    server.shutdown()
    calc = results[0]
    sync = _pool([results[1], results[4]])
    overlapped = _pool([results[2], results[3]])
    for res in (sync, overlapped):
        if res["tool_calls_mean"] < 0.5:  # the model did not call the tool: nothing measured
            raise SystemExit(
                f"agents: no ratio: {res['run']} made {res['tool_calls_mean']:.2f} tool calls/episode"
            )
    ratio = overlapped["episodes_per_h"] / sync["episodes_per_h"] if sync["episodes_per_h"] else 0.0
    if args.json:
        print(json.dumps({"runs": results, "overlap_ratio": ratio, "engine": args.engine}, indent=2))
    print(
        f"agents: episodes/h {calc['episodes_per_h']:.0f} calculator, "
        f"{sync['episodes_per_h']:.0f} http sync, "
        f"{overlapped['episodes_per_h']:.0f} http maxStaleness 1 (x{ratio:.2f}), "
        f"tool time share {sync['tool_time_share']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
