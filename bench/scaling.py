"""How the DPO step's cost grows with sequence length and batch size on the real model.

    .venv/bin/python bench/scaling.py                                   # lengths 128..1024 x pairs 2, 4, 8
    .venv/bin/python bench/scaling.py --lengths 128 256 --pairs 2 4 --steps 2

For every (max_length, pairs) it builds the pairs of ``bench/common.py`` with prompt = 1/4 of the length and
chosen/rejected filling the rest (real text, the real tokenizer), runs DPO steps exactly as
``bench/bench_preference.py`` (reference pass, policy forward/backward of chosen+rejected, clipping, AdamW) and
prints the median step time after one warm-up step, the step time per 1,000 real tokens, tokens/s and the
process's peak RSS growth over the model-loaded baseline (``ru_maxrss``, KiB on Linux: the high-water mark, so
each row is run in a fresh process to be its own).

Read the "s per 1k tokens" column: constant = linear cost in tokens. The matmuls are linear in tokens; attention
is quadratic in length (scores: 2 x layers x heads x T^2 x head_dim FLOPs per sequence), so the per-token cost
rises with length once T approaches d_model x (linear-layer width ratio); with SmolLM2 (d = 576, 30 layers) that
is a few hundred tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(length: int, pairs: int, steps: int, model: str) -> dict:
    """Run in this process: DPO steps at (length, pairs)."""
    import statistics
    import time

    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from common import compose, peak_rss_gb

    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.data.preference import PreferenceExample, collate_preferences, prompt_text
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy
    from prefzoo.training.step import accumulate_gradients

    cfg = compose(["algo=dpo", f"model={model}", f"data.max_length={length}", f"data.max_prompt_length={length // 2}", "model.lora.r=16", "model.lora.alpha=32"])
    algo = get_algorithm("dpo")(cfg.algo, resolve_objective(cfg))
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    base_rss = peak_rss_gb()
    from common import ANSWER, STORY, _numbers, long_prompt

    examples = []
    for i in range(pairs):
        prompt = tok(prompt_text(tok, long_prompt(i, n_stories=12)), add_special_tokens=False)["input_ids"][-(length // 4):]
        worked = "".join(ANSWER.format(**_numbers(i + k)) for k in range(40))
        room = length - len(prompt) - 1
        chosen = tok(worked, add_special_tokens=False)["input_ids"][:room]
        rejected = tok(worked.replace("+", "-"), add_special_tokens=False)["input_ids"][:room]
        examples.append(PreferenceExample(prompt, chosen + [tok.eos_token_id], rejected + [tok.eos_token_id]))
    batch = collate_preferences(examples, list(range(pairs)), tok.pad_token_id)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, built.policy, batch, pairs)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    tokens = batch.num_tokens()
    return {"length": length, "pairs": pairs, "tokens": tokens, "step_s": step, "s_per_1k": 1000 * step / tokens,
            "tokens_per_s": tokens / step, "rss_gb": peak_rss_gb(), "rss_growth_gb": peak_rss_gb() - base_rss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024])
    ap.add_argument("--pairs", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--one", nargs=2, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], args.one[1], args.steps, args.model)), flush=True)
        return 0
    print(f"# DPO step, {args.model}, LoRA r=16 all linear, fp32, {os.cpu_count()} CPUs; median of {args.steps} "
          "steps after 1 warm-up; one process per row")
    print("| max_length | pairs | real tokens | step (s) | s per 1k tokens | tokens/s | peak RSS (GB) | RSS over model (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        for pairs in args.pairs:
            out = subprocess.run([sys.executable, __file__, "--one", str(length), str(pairs), "--steps", str(args.steps),
                                  "--model", args.model], capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"| {length} | {pairs} | failed: {out.stderr.strip().splitlines()[-1:]} |", flush=True)
                continue
            r = json.loads(line[7:])
            print(f"| {length} | {pairs} | {r['tokens']} | {r['step_s']:.2f} | {r['s_per_1k']:.2f} | "
                  f"{r['tokens_per_s']:.0f} | {r['rss_gb']:.2f} | {r['rss_growth_gb']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
