"""Step time of 1 process vs N data-parallel processes (torchrun, gloo on CPU), same global batch.

    .venv/bin/python bench/bench_data_parallel.py                      # tiny DPO and GRPO, 2 cores: 1x2 vs 2x1 threads
    .venv/bin/python bench/bench_data_parallel.py --algos grpo --steps 12 --processes 2 --threads 2
    .venv/bin/python bench/bench_data_parallel.py --model smollm2       # the real model (slow on a CPU)

Each configuration is a real ``train.py`` run in a subprocess (``python train.py`` for one process,
``torchrun --standalone --nproc_per_node N train.py`` for N), with evaluation off and no checkpoints. The fair
comparison on a machine with C cores is one process of C threads against N processes of C/N threads each
(``trainer.num_threads``): both use every core; one process of C/N threads is shown too. The numbers are the median over the steps after the first
(``--warmup``) of the loop's own timers, global over processes (the slowest process): ``time/step`` (the
whole step), ``time/experience`` (batching; for GRPO the rollout, scoring and old log-probs) and
``time/update`` (forward/backward, the all-reduce and the optimizer step).

Workloads (``trainer.batch_size`` is the global batch):

* dpo:  tests/fixtures/arithmetic_pairs.jsonl, 8 pairs per step, micro-batches of 4 per process.
* grpo: arithmetic prompts, 4 prompts x 4 samples per step, 16 new tokens, reward = completion length / 10
  (tests/distributed/rewards.py: the untrained tiny model never solves a sum).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["trainer.progress=false", "trainer.tensorboard=false", "trainer.device=cpu", "trainer.save_every=0",
         "eval.before=false", "eval.after=false"]
WORKLOADS = {
    "dpo": ["algo=dpo", "data=file", f"data.path={ROOT / 'tests/fixtures/arithmetic_pairs.jsonl'}",
            "data.max_length=96", "data.max_prompt_length=64", "trainer.batch_size=8", "trainer.micro_batch_size=4"],
    "grpo": ["algo=grpo", "data=arithmetic", "data.num_train=64", "data.num_eval=2",
             "reward.functions=[tests.distributed.rewards:length]", "algo.num_samples=4",
             "rollout.max_new_tokens=16", "trainer.batch_size=4", "trainer.micro_batch_size=16"],
}
TIMERS = ("time/step", "time/experience", "time/update")


def run(algo: str, model: str, processes: int, threads: int, steps: int) -> list[dict]:
    """The metrics.jsonl records of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [*WORKLOADS[algo], f"model={model}", f"trainer.max_steps={steps}", f"trainer.num_threads={threads}",
                *QUIET, f"hydra.run.dir={tmp}"]
        if processes == 1:
            command = [sys.executable, str(ROOT / "train.py"), *args]
        else:
            command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node",
                       str(processes), str(ROOT / "train.py"), *args]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        return [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", nargs="+", default=["dpo", "grpo"], choices=sorted(WORKLOADS))
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="cores to use in total")
    args = parser.parse_args()
    n, cores = args.processes, args.threads
    configs = [(1, cores), (1, max(1, cores // n)), (n, max(1, cores // n))]  # the fair pair, and one process alone
    print(f"model={args.model}, {args.steps - args.warmup} measured steps, median seconds (global: the slowest process)")
    print(f"{'algo':6} {'processes x threads':20} " + " ".join(f"{t:>16}" for t in TIMERS) + f" {'speed-up':>9}")
    for algo in args.algos:
        base = None
        for processes, threads in configs:
            records = run(algo, args.model, processes, threads, args.steps)[args.warmup:]
            med = {t: statistics.median(r[t] for r in records) for t in TIMERS}
            base = base or med["time/step"]
            print(f"{algo:6} {f'{processes} x {threads}':20} " + " ".join(f"{med[t]:16.3f}" for t in TIMERS)
                  + f" {base / med['time/step']:9.2f}", flush=True)


if __name__ == "__main__":
    main()
