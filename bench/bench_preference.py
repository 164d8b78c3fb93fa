"""Benchmark the offline plugins' training steps on the real model: step time, tokens/s, peak memory.

    .venv/bin/python bench/bench_preference.py                    # DPO, SimPO, ORPO, SFT and KTO, the issue's setting
    .venv/bin/python bench/bench_preference.py --algos dpo --steps 8 --max-length 512
    .venv/bin/python bench/bench_preference.py --algos dpo dpo:robust dpo:apo_zero dpo:sigmoid+sft
    .venv/bin/python bench/bench_preference.py --all-loss-types   # DPO with every loss type of the table

An entry ``dpo:<loss_type>`` runs DPO with ``algo.loss_type=<loss_type>`` (``a+b``: the sum of both, weight 1
each; ``robust``, ``exo_pair`` and ``aot*`` get ``algo.label_smoothing=0.1`` / ``1e-3`` / ``0``). ORPO, SimPO and
SFT need no reference forward, so their steps should be faster than DPO's. KTO reads the same pairs split into
unpaired rows (chosen desirable, rejected undesirable: 2 x ``--pairs`` rows, the same tokens as DPO's step) and
pays one more no-grad pass of the policy and the reference over the step's mismatched rows (its z0).

Setting (the same as the TRL comparison in bench/compare_trl.py): SmolLM2-135M-Instruct, LoRA r=16
alpha=32 on all linear layers, fp32, 4 preference pairs per step, max_length 256. The pairs are real
text (arithmetic word problems with long worked answers) tokenised by the real tokenizer, padded as in
training; about 1,750 real tokens per step (prompt counted twice, chosen, rejected).

A step is exactly what the trainer does: reference log-probs (no grad), the policy forward/backward over
chosen+rejected in one concatenated pass, gradient clipping and the AdamW step. Reported: the median
step time after ``--warmup`` steps, real tokens per second, and the process's peak RSS (``ru_maxrss``,
model loading included).
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, example_pairs, peak_rss_gb  # noqa: E402


#: extra overrides a loss type needs to run (its paper's setting)
LOSS_TYPE_OVERRIDES = {"robust": ["algo.label_smoothing=0.1"], "exo_pair": ["algo.label_smoothing=1e-3"]}


def entry_overrides(entry: str) -> tuple[str, list[str]]:
    """``dpo:robust`` -> ("dpo", ["algo.loss_type=robust", "algo.label_smoothing=0.1"]); ``orpo`` -> ("orpo", [])."""
    algo_name, _, loss_type = entry.partition(":")
    if not loss_type:
        return algo_name, []
    types = loss_type.split("+")
    value = types[0] if len(types) == 1 else "[" + ",".join(types) + "]"
    return algo_name, [f"algo.loss_type={value}"] + [o for t in types for o in LOSS_TYPE_OVERRIDES.get(t, [])]


def bench(entry: str, args) -> dict:
    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.data.preference import collate_preferences
    from prefzoo.data.unpaired import collate_unpaired, split_pairs
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy
    from prefzoo.training.step import accumulate_gradients

    algo_name, extra = entry_overrides(entry)
    cfg = compose([f"algo={algo_name}", f"model={args.model}", f"data.max_length={args.max_length}",
                   f"model.lora.r={args.lora_r}", f"model.lora.alpha={2 * args.lora_r}"] + extra)
    algo = get_algorithm(algo_name)(cfg.algo, resolve_objective(cfg))
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    examples = example_pairs(tok, args.pairs, args.max_length)
    batch = collate_preferences(examples, list(range(len(examples))), tok.pad_token_id)
    tokens = batch.num_tokens()
    rows = len(examples)
    if algo.declaration.data == "unpaired":  # KTO: the pairs' sides as rows (the same tokens)
        unpaired = split_pairs(examples)
        batch, rows = collate_unpaired(unpaired, list(range(len(unpaired))), tok.pad_token_id), len(unpaired)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, built.policy, batch, rows)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    measured = times[args.warmup:]
    step = statistics.median(measured)
    return {"algo": entry, "step_s": step, "spread_s": max(measured) - min(measured),
            "tokens": tokens, "tokens_per_s": tokens / step, "peak_rss_gb": peak_rss_gb()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algos", nargs="+", default=["dpo", "simpo", "orpo", "sft", "kto"])
    ap.add_argument("--all-loss-types", action="store_true", help="add dpo:<t> for every loss type of the table")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    if args.all_loss_types:
        from prefzoo.objective import PAIRWISE_LOSSES

        args.algos += [f"dpo:{t}" for t in PAIRWISE_LOSSES if t != "sigmoid"]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# {args.model}, LoRA r={args.lora_r}, fp32, {args.pairs} pairs, max_length {args.max_length}")
    print("| algo | step (s, median) | spread (s) | real tokens/step | tokens/s | peak RSS (GB) |")
    print("|---|---|---|---|---|---|")
    for name in args.algos:  # peak RSS is per process: the first algorithm's figure is the cleanest
        r = bench(name, args)
        print(f"| {r['algo']} | {r['step_s']:.2f} | {r['spread_s']:.2f} | {r['tokens']} | {r['tokens_per_s']:.0f} | "
              f"{r['peak_rss_gb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
