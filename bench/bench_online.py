"""Benchmark one training step of every online plugin on the same rollout shape: step time, tokens/s, peak RSS.

    .venv/bin/python bench/bench_online.py                          # SmolLM2-135M, grpo rloo reinforce_pp gspo cispo online_dpo
    .venv/bin/python bench/bench_online.py --model tiny --steps 2   # a smoke test of the script itself
    .venv/bin/python bench/bench_online.py --algos grpo gspo --prompts 4 --max-new-tokens 48
    .venv/bin/python bench/bench_online.py --algos grpo ppo ppo:algo.epochs=2 ppo:algo.epochs=1 ppo:algo.value_adapter=shared

Setting: each algorithm in its own process (so peak RSS is its own), built by the training loop
(:class:`prefzoo.training.loop.Trainer`) with its own defaults (beta, estimator, placement, epochs and
mini-batches: GSPO and CISPO take 4 optimizer steps per rollout and one more no-grad pass for log pi_old) and
the same rollout shape: ``--prompts`` prompts x ``--samples`` completions of exactly ``--max-new-tokens`` tokens
(end-of-sequence ignored), LoRA r=16 alpha=32 on all linear layers, fp32, rollout temperature 0.7. A step is the
loop's ``train_step``: sampling, scoring, the no-grad passes, every optimizer step. Reported: median over the
measured steps (after ``--warmup``) of the step time and its parts (the loop's ``time/experience`` and
``time/update``), generated tokens per second of the whole step, peak RSS (``ru_maxrss``, model loading
included), and the step time relative to GRPO's. An entry ``name:key=value[,key=value]`` adds those overrides,
which win over the bench's own (e.g. ``ppo:algo.epochs=1``). PPO is measured on the same rollout (``--prompts`` x
``--samples`` rows, one value adapter, its own 4 epochs by default) for issue 15's "PPO step <= 2.5x GRPO's".
Online DPO samples 2 per prompt whatever ``--samples`` says, so its same rollout is
``online_dpo:trainer.batch_size=4`` (4 x 2 rows against 2 x 4; its generated tokens are counted as such).
Distillation (``distill``: the JSD over the whole vocabulary; ``teacher_reward``: the teacher's
log-prob of the sampled tokens as a reward) distils from ``--model`` itself unless the entry gives ``algo.teacher``:
the teacher is a second, frozen copy of the model (its cost is what is measured, not what it teaches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, peak_rss_gb  # noqa: E402

ALGOS = ("grpo", "rloo", "reinforce_pp", "gspo", "cispo", "online_dpo", "distill", "teacher_reward")


def one(args) -> dict:
    """Measure ``args.one`` in this process; returns the medians."""
    import torch

    from prefzoo.training.loop import Trainer

    torch.manual_seed(0)
    model = f"model={args.model}" if args.model in ("smollm2", "tiny") else f"model.name={args.model}"
    name, _, extra = args.one.partition(":")
    samples = [] if name == "online_dpo" else [f"algo.num_samples={args.samples}"]  # online DPO: always 2
    if name == "distill" and "algo.teacher=" not in extra:  # the base model as its own teacher: a frozen second copy
        samples.append(f"algo.teacher={args.model}")
    cfg = compose([f"algo={name}", model, "reward=arithmetic", *samples,
                   "model.lora.r=16", "model.lora.alpha=32", "model.lora.target_modules=all-linear",
                   "model.dtype=float32", f"trainer.batch_size={args.prompts}", "rollout.temperature=0.7",
                   f"rollout.max_new_tokens={args.max_new_tokens}", f"trainer.max_steps={args.steps + args.warmup}",
                   f"trainer.num_threads={args.threads}", f"trainer.device={args.device}", "trainer.progress=false",
                   "trainer.tensorboard=false", "trainer.save_every=0", "eval.before=false", "eval.after=false",
                   "data.num_train=64", *[kv for kv in extra.split(",") if kv]])  # the entry's own last: they win
    trainer = Trainer(cfg, Path(args.run_dir) / args.one.replace(":", "_").replace("=", "-").replace(",", "_"))
    trainer.policy.eos_token_ids = [-1]  # never stop early: every step generates exactly max_new_tokens
    rows = [trainer.train_step() for _ in range(args.steps + args.warmup)][args.warmup:]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    d = trainer.algo.declaration
    tokens = cfg.trainer.batch_size * d.num_samples * args.max_new_tokens
    return {"algo": args.one, "step": med("time/step"), "experience": med("time/experience"),
            "update": med("time/update"), "tokens_per_s": tokens / med("time/step"), "peak_rss_gb": peak_rss_gb(),
            "optimizer_steps": d.epochs * d.num_minibatches, "reference": d.reference}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--run-dir", default="/tmp/prefzoo_bench_online")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one algorithm, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return 0
    print(f"# {args.model}, LoRA r=16 alpha=32 all-linear, fp32, {args.prompts} prompts x {args.samples} samples x "
          f"{args.max_new_tokens} new tokens; median of {args.steps} steps after {args.warmup} warm-up")
    print("| algo | optimizer steps | reference | step (s) | experience (s) | update (s) | generated tok/s | "
          "peak RSS (GB) | step / GRPO's |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = None
    for algo in args.algos:
        cmd = [sys.executable, __file__, "--one", algo, "--model", args.model, "--prompts", str(args.prompts),
               "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--threads", str(args.threads), "--device", args.device,
               "--run-dir", args.run_dir]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            print(f"| {algo} | failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        base = r["step"] if algo == "grpo" else base
        ratio = f"{r['step'] / base:.2f}" if base else "—"
        print(f"| {algo} | {r['optimizer_steps']} | {'yes' if r['reference'] else 'no'} | {r['step']:.2f} | "
              f"{r['experience']:.2f} | {r['update']:.2f} | {r['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} | "
              f"{ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
