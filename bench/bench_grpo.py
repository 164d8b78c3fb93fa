"""Benchmark GRPO steps on the real model: generation vs training time, generated tokens/s, peak memory.

    .venv/bin/python bench/bench_grpo.py                 # beta = 0 and beta = 0.04, the issue's setting
    .venv/bin/python bench/bench_grpo.py --betas 0 --prompts 4 --generations 8

Setting: SmolLM2-135M-Instruct, LoRA r=16 alpha=32 on all linear layers, fp32, 2 arithmetic prompts x 4
generations, exactly 64 new tokens per completion (end-of-sequence ignored, so every step does the same
work). A step is what the trainer does: sampling (prefzoo.rollout), scoring, the no-grad passes (reference
log-probs: always with LoRA, for the drift metrics; they enter the loss only when beta > 0), then the
policy forward/backward and the AdamW step. Reported: median over steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, peak_rss_gb  # noqa: E402


def bench(beta: float, args) -> dict:
    from prefzoo.algos import get_algorithm
    from prefzoo.types import SamplingParams
    from prefzoo.config import resolve_objective
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.scoring import TextScorer
    from prefzoo.training.build import build_policy
    from prefzoo.training.setup import build_reward, task_prompts
    from prefzoo.training.step import accumulate_gradients

    cfg = compose(["algo=grpo", f"model={args.model}", f"objective.beta={beta}", f"algo.num_samples={args.generations}",
                   f"model.lora.r={args.lora_r}", f"model.lora.alpha={2 * args.lora_r}"])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    algo = get_algorithm("grpo")(cfg.algo, resolve_objective(cfg), sampling)
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    policy = built.policy
    policy.eos_token_ids = [-1]  # never stop early: every step generates exactly max_new_tokens
    train, _ = task_prompts(cfg, tok)
    scorer = TextScorer(tok, build_reward(cfg), policy.pad_id)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    rows = []
    for i in range(args.warmup + args.steps):
        prompts = train.batch(list(range(i * args.prompts, (i + 1) * args.prompts)), policy.pad_id)
        t0 = time.perf_counter()
        exp, m = algo.make_experience(policy, prompts, scorer)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, policy, exp, args.prompts * args.generations)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        t2 = time.perf_counter()
        rows.append({"step": t2 - t0, "generation": m["time/generation"], "no_grad_passes": m["time/scoring_and_ref"],
                     "train": t2 - t1, "gen_tok_s": m["generated_tokens_per_second"]})
    rows = rows[args.warmup:]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"beta": beta, **med, "peak_rss_gb": peak_rss_gb(), "ref": policy.reference.kind if policy.reference else "none"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--betas", nargs="+", type=float, default=[0.0, 0.04])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; {args.model}, LoRA r={args.lora_r}, fp32, "
          f"{args.prompts} prompts x {args.generations} generations x {args.max_new_tokens} new tokens")
    print("| beta | reference | step (s) | generation (s) | no-grad passes (s) | training (s) | generated tok/s | peak RSS (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for beta in args.betas:
        r = bench(beta, args)
        print(f"| {r['beta']} | {r['ref']} | {r['step']:.2f} | {r['generation']:.2f} | {r['no_grad_passes']:.2f} | "
              f"{r['train']:.2f} | {r['gen_tok_s']:.0f} | {r['peak_rss_gb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
