"""Benchmark one held-out evaluation point on the real model: where its time goes, and the reward model's fast path.

    .venv/bin/python bench/bench_eval.py --reward-path <an algo=rm run>            # the over-optimisation design
    .venv/bin/python bench/bench_eval.py --reward-path RUN --prompts 32 --plain     # the scorer's plain pass

Setting: the over-optimisation recipe's evaluation (``+recipe=overoptimisation_word``, issue 32): SmolLM2-135M-Instruct
with a LoRA adapter, word problems, 64 new tokens; ``--prompts`` held-out prompts answered greedily and sampled 4
times at temperature 1 (the recipe: 96 and 96 x 4 = 384); the proxy is a reward model (``reward=model``) scoring
every answer, the gold is the verifier. One thread (``--threads``). Timed: the greedy part
(:meth:`~prefzoo.evaluation.evaluate.Evaluator.task_metrics`), the sampled part (``sampled_metrics``) split into
sampling, scoring (proxy + gold), the policy's log-prob/entropy pass and the reference pass, and pass@4.
``--plain`` measures the evaluation as it was before issue 32: the reward model's plain pass (adapter unmerged, rows
padded) instead of :class:`~prefzoo.rewards.model.RewardModelFunction`'s fast one (adapter merged, rows packed,
prompts shared), and the policy's log-prob/entropy pass over the samples instead of the sampler's own values
(``eval.sampler_logps``, on in the recipe).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, peak_rss_gb  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reward-path", required=True, help="an algo=rm run folder (the proxy)")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--plain", action="store_true", help="the evaluation before issue 32: the reward model's plain "
                    "pass, the policy's log-prob pass")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import prefzoo.rewards.model as reward_model
    from prefzoo.training.loop import Trainer

    if args.plain:  # the scorer the run builds (prefzoo.training.setup.build_reward), on its plain pass
        reward_model.reward_model_function = lambda path: reward_model.RewardModelFunction(
            reward_model.find_reward_model(path), fast=False)
    cfg = compose(["+recipe=overoptimisation_word", "+recipe/overoptimisation_points=grpo_beta0",
                   f"eval.sampler_logps={not args.plain}", f"reward.path={args.reward_path}",
                   f"trainer.num_threads={args.threads}", "trainer.progress=false",
                   f"eval.num_problems={args.prompts}", f"eval.diversity_prompts={args.prompts}",
                   f"eval.batch_size={args.batch_size}"])
    trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="bench-eval-")))
    ev = trainer.evaluator
    parts: dict[str, float] = {}

    def timed(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - t
        setattr(obj, name, wrapper)

    timed(ev.policy, "sample", "sampling")
    timed(ev.policy, "logps", "policy log-probs + entropy")
    timed(ev.policy, "ref_logps", "reference log-probs")
    timed(ev, "_try_score", "scoring (proxy + gold)")
    rows = {}
    with ev.policy.seeded(torch.Generator().manual_seed(0)):
        for name in ("task_metrics", "sampled_metrics", "pass_at_k"):
            parts.clear()
            t = time.perf_counter()
            out = getattr(ev, name)()
            rows[name] = {"seconds": time.perf_counter() - t, **parts,
                          "tokens": out.get("completion_length", 0) * args.prompts * cfg.eval.diversity_samples
                          if name == "sampled_metrics" else None}
    total = sum(r["seconds"] for r in rows.values())
    print(f"# one evaluation point: {args.prompts} greedy answers, {args.prompts} x {cfg.eval.diversity_samples} "
          f"samples, pass@4 on {cfg.eval.pass_k_problems}; {'before (plain passes)' if args.plain else 'after'}; "
          f"{args.threads} thread(s)")
    for name, r in rows.items():
        detail = ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k not in ("seconds", "tokens"))
        print(f"{name}: {r['seconds']:.1f} s ({detail})")
    print(f"total {total:.1f} s; peak RSS {peak_rss_gb():.2f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "total_s": total, "plain": args.plain,
                                               "prompts": args.prompts}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
