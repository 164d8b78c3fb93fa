"""Padded vs padding-free (``model.fast.padding_free``) DPO steps on the real model: step time, tokens/s, peak RSS.

    .venv/bin/python bench/bench_packing.py                 # both distributions, both layouts (~5 min of one core)
    .venv/bin/python bench/bench_packing.py --only builtin  # the built-in arithmetic pairs only
    .venv/bin/python bench/bench_packing.py --attention     # the attention kernels alone (dense 4-D mask vs segments)

Two length distributions:

* ``builtin``: the built-in on-policy arithmetic pairs (``$PREFZOO_CACHE/pairs/arithmetic-*/train.jsonl``, built by
  ``prefzoo pairs``): ~30-token prompts, chosen often short ("90 + 71 = 161"), rejected up to 48 tokens;
  4 pairs per step (the default ``trainer.batch_size`` and ``micro_batch_size``).
* ``mix``: synthetic pairs, prompts of 32-64 tokens, chosen and rejected each of 32-1024 tokens (uniform,
  independent), 2 pairs per step; several batches, to see how the step time scales with the real tokens.

SmolLM2-135M-Instruct, LoRA r=16 on all linear layers, fp32, ONE torch thread, every fast path on except the one
compared. A step is what the trainer does: reference log-probs (no grad), the policy's forward/backward over chosen
and rejected, clipping, AdamW. Each (distribution, layout) runs in its own process, so peak RSS (``ru_maxrss``,
model loading included) is its own. Reported per batch: real tokens (prompt once per pair + both completions: what
the packed pass reads), padded positions (pairs x longest prompt + 2 x pairs x longest completion: what the padded
pass runs, prompts shared through a KV cache), the step time, and
seconds per 1,000 real tokens -- constant if the step time is proportional to the real tokens. Step times are the
process's CPU time (``time.process_time``, one thread): on a shared machine the wall time also counts the time
other processes held the core (both are in ``--json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, peak_rss_gb  # noqa: E402


def builtin_examples(tok, max_length: int = 256):
    from prefzoo.data.preference import load_table, tokenize_preferences
    from prefzoo.models.loading import cache_dir

    files = sorted((cache_dir() / "pairs").glob("arithmetic-*/train.jsonl"))
    if not files:
        sys.exit("no built-in pairs under $PREFZOO_CACHE/pairs: run `prefzoo pairs` first")
    return tokenize_preferences(load_table(str(files[0])), tok, max_length, 128)


def mix_examples(n: int, seed: int = 0):
    from prefzoo.data.preference import PreferenceExample

    rng = random.Random(seed)
    length = lambda: rng.randrange(32, 1025)  # noqa: E731
    ids = lambda k: [rng.randrange(100, 49000) for _ in range(k - 1)] + [2]  # noqa: E731
    return [PreferenceExample(ids(rng.randrange(32, 65)), ids(length()), ids(length())) for _ in range(n)]


def batch_sizes(batch) -> dict:
    """Real tokens (what the packed pass reads) and the positions the padded pass runs: each pair's prompt once at
    the longest prompt's width (``share_prompts``: chosen and rejected read it from one KV cache), then 2B rows at
    the longest completion's width."""
    p = int(batch.chosen.prompt_mask.sum())
    c, r = int(batch.chosen.completion_mask.sum()), int(batch.rejected.completion_mask.sum())
    width = max(batch.chosen.completion_ids.shape[1], batch.rejected.completion_ids.shape[1])
    return {"real": p + c + r, "padded": len(batch) * batch.chosen.prompt_ids.shape[1] + 2 * len(batch) * width}


def make_batches(dist: str, tok, args):
    """(examples, pairs per step, the steps' example indices) of a distribution (deterministic)."""
    if dist == "builtin":
        examples, per = builtin_examples(tok), 4
        order = list(range(len(examples)))
        random.Random(1).shuffle(order)
        return examples, per, [order[i * per:(i + 1) * per] for i in range(args.builtin_steps)]
    examples, per = mix_examples(2 * args.mix_batches), 2
    return examples, per, [list(range(i * per, (i + 1) * per)) for i in range(args.mix_batches)]


def worker(dist: str, layout: str, args) -> dict:
    """One process: build the DPO run, time its steps on the distribution's batches."""
    torch.set_num_threads(1)
    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.data.preference import collate_preferences
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy
    from prefzoo.training.step import accumulate_gradients

    cfg = compose(["algo=dpo", f"model={args.model}", f"model.fast.padding_free={layout == 'packed'}"])
    algo = get_algorithm("dpo")(cfg.algo, resolve_objective(cfg))
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    assert built.policy.padding_free == (layout == "packed")
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    examples, per, batches = make_batches(dist, tok, args)
    rows = []

    def run(idx):
        batch = collate_preferences([examples[i] for i in idx], idx, tok.pad_token_id)
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, built.policy, batch, per)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0, batch

    first = examples[batches[0][0]]  # warm-up (first-call costs) on a short pair
    examples.append(type(first)(first.prompt_ids[-8:], first.chosen_ids[:8], first.rejected_ids[:8]))
    run([len(examples) - 1])
    for idx in batches:
        wall, cpu, batch = run(idx)
        rows.append({**batch_sizes(batch), "wall_s": wall, "step_s": cpu})
    return {"dist": dist, "layout": layout, "batches": rows, "peak_rss_gb": peak_rss_gb()}


def attention_bench() -> None:
    """One attention layer's forward + backward on SmolLM2's heads (9 query, 3 key-value, head 64), 1 thread."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    h, kv, hd = 9, 3, 64

    def best(fn, reps=4):
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return 1e3 * min(out)

    print("| segments x tokens | SDPA, 4-D block mask (ms) | SDPA per segment (ms) | padded rows, causal (ms) |")
    print("|---|---|---|---|")
    for seg, n in ((128, 16), (256, 8), (512, 4)):
        big = seg * n
        q, k, v = (torch.randn(1, x, big, hd, requires_grad=True) for x in (h, kv, kv))
        ids = torch.arange(big) // seg
        mask = ((ids[:, None] == ids[None, :]) & torch.ones(big, big, dtype=torch.bool).tril())[None, None]
        dense = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()  # noqa: E731
        loop = lambda: torch.cat([F.scaled_dot_product_attention(  # noqa: E731
            q[:, :, s:s + seg], k[:, :, s:s + seg], v[:, :, s:s + seg], is_causal=True, enable_gqa=True)
            for s in range(0, big, seg)], 2).sum().backward()
        qb, kb, vb = (torch.randn(n, x, seg, hd, requires_grad=True) for x in (h, kv, kv))
        rows = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True).sum().backward()  # noqa: E731
        print(f"| {n} x {seg} | {best(dense):.0f} | {best(loop):.0f} | {best(rows):.0f} |", flush=True)


def report(results: list[dict]) -> None:
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread; SmolLM2-135M, LoRA "
          "r=16, fp32, DPO")
    print("| pairs | layout | step (CPU s, median) | real tokens/step | padded positions/step | real tokens/s | "
          "s per 1k real tokens (min-max) | peak RSS (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        b = r["batches"]
        real = sum(x["real"] for x in b) / len(b)
        padded = sum(x["padded"] for x in b) / len(b)
        per_k = [1e3 * x["step_s"] / x["real"] for x in b]
        step = statistics.median(x["step_s"] for x in b)
        tps = sum(x["real"] for x in b) / sum(x["step_s"] for x in b)
        print(f"| {r['dist']} | {r['layout']} | {step:.2f} | {real:.0f} | {padded:.0f} | {tps:.0f} | "
              f"{min(per_k):.2f}-{max(per_k):.2f} | {r['peak_rss_gb']:.2f} |")
    for r in results:
        if r["dist"] != "mix":
            continue
        b = r["batches"]
        print(f"\n{r['dist']} / {r['layout']}: per batch (real tokens, padded positions, step CPU s, s per 1k real, "
              "s per 1k padded)")
        for x in b:
            print(f"  {x['real']:5d} {x['padded']:5d} {x['step_s']:6.2f} {1e3 * x['step_s'] / x['real']:.2f} "
                  f"{1e3 * x['step_s'] / x['padded']:.2f}")
        per_k = [x["step_s"] / x["real"] for x in b]
        mean = statistics.mean(per_k)
        spread = max(abs(p / mean - 1) for p in per_k)
        print(f"  seconds per real token vary by at most {100 * spread:.0f}% around their mean "
              f"({'within' if spread <= 0.15 else 'NOT within'} 15%: step time proportional to real tokens)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["builtin", "mix"])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--builtin-steps", type=int, default=4)
    ap.add_argument("--mix-batches", type=int, default=3)
    ap.add_argument("--attention", action="store_true", help="the attention kernels alone")
    ap.add_argument("--worker", nargs=2, metavar=("DIST", "LAYOUT"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--report", metavar="JSON", help="print the tables of earlier raw results (no run)")
    args = ap.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    if args.attention:
        attention_bench()
        return 0
    if args.worker:
        print(json.dumps(worker(*args.worker, args)))
        return 0
    results = []
    for dist in [args.only] if args.only else ["builtin", "mix"]:
        for layout in ("padded", "packed"):
            cmd = [sys.executable, __file__, "--worker", dist, layout, "--model", args.model,
                   "--builtin-steps", str(args.builtin_steps), "--mix-batches", str(args.mix_batches)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(f"# {dist} {layout} done: {json.dumps(results[-1])}", file=sys.stderr, flush=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
