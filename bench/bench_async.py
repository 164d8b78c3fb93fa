"""Synchronous against asynchronous rollouts on the real model: step time, prompts per second, the trainer's wait for
its rollout, peak memory (issue 29).

    .venv/bin/python bench/bench_async.py                                   # SmolLM2-135M, 6 steps per setting
    .venv/bin/python bench/bench_async.py --steps 10 --settings sync:2 async:1
    .venv/bin/python bench/bench_async.py --model tiny --steps 3            # a smoke test of the script itself
    .venv/bin/python bench/bench_async.py --extra rollout.dtype=bfloat16 trainer.kl_metric_every=0   # every setting

Each setting is one ``python train.py algo=grpo`` run in its own process (no evaluation), the default GRPO rollout
(8 prompts x 4 samples, 64 new tokens at most, temperature 0.7) on the arithmetic task:

* ``sync:T``: the synchronous loop with T torch threads (T = 2: both cores for the one process);
* ``async:K``: ``rollout.asynchronous=true rollout.max_staleness=K``, the trainer and the worker one thread each.

Reported per setting, over the steps after the first (which includes the worker's start): median step time (the
loop's ``time/step``: waiting for the rollout, scoring, the no-grad passes, the update), prompts per second (8 /
step time), the median wait for the rollout (``time/generation``: in the synchronous loop the sampling itself), the
worker's own sampling time (``async/worker_seconds``), and the peak RSS of the largest process (the trainer; the
worker is about the model's size again). Say the machine's load with the figures (``uptime`` is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(setting: str, steps: int, model: str, folder: Path, extra_overrides: list[str]) -> dict:
    kind, _, value = setting.partition(":")
    extra = [f"trainer.num_threads={value}"] if kind == "sync" else [
        "trainer.num_threads=1", "rollout.asynchronous=true", f"rollout.max_staleness={value}"]
    out = folder / setting.replace(":", "-")
    cmd = [sys.executable, str(ROOT / "train.py"), "algo=grpo", f"model={model}", f"trainer.max_steps={steps}",
           "eval.before=false", "eval.after=false", "trainer.progress=false", "trainer.save_every=0",
           "trainer.tensorboard=false", *extra, *extra_overrides, f"hydra.run.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": value if kind == "sync" else "1", "TQDM_DISABLE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{setting}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.median(r["time/step"] for r in rows)
    return {"setting": setting, "steps": len(rows), "step_s": step, "prompts_per_s": 8 / step,
            "wait_s": statistics.median(r["time/generation"] for r in rows),
            "worker_s": statistics.median(r["async/worker_seconds"] for r in rows) if kind == "async" else None,
            "staleness": [r.get("async/staleness") for r in rows] if kind == "async" else None,
            "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--settings", nargs="+", default=["sync:2", "async:0", "async:1", "async:2"])
    parser.add_argument("--extra", nargs="*", default=[], help="train.py overrides added to every setting")
    args = parser.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(s, args.steps, args.model, Path(tmp), args.extra) for s in args.settings]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"\nGRPO, model={args.model}, {args.steps} steps per setting (the first not counted); peak RSS of the largest "
          f"process {rss:.0f} MiB; overrides: {' '.join(args.extra) or 'none'}\n")
    print("| setting | median step s | prompts / s | vs the first | median wait for the rollout s | worker sampling s | staleness |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        worker = "" if r["worker_s"] is None else f"{r['worker_s']:.1f}"
        staleness = "" if r["staleness"] is None else ",".join(str(int(s)) for s in r["staleness"])
        speed = r["prompts_per_s"] / results[0]["prompts_per_s"]
        print(f"| {r['setting']} | {r['step_s']:.1f} | {r['prompts_per_s']:.3f} | {speed:.2f}x | {r['wait_s']:.1f} | "
              f"{worker} | {staleness} |")
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
