"""Benchmark GRPO steps with rollout.engine=hf vs vllm on the real model: step time, generation share, peak memory,
and the engine/trainer log-prob mismatch (issue 18). Runs in the vLLM venv (``make setup-vllm``):

    .venv-vllm/bin/python bench/bench_vllm.py --engine hf
    .venv-vllm/bin/python bench/bench_vllm.py --engine vllm
    .venv-vllm/bin/python bench/bench_vllm.py --engine vllm --prompts 8 --max-new-tokens 128

One engine per process (run the two engines as two commands, so each one's peak memory is its own). Setting as
bench/bench_grpo.py: SmolLM2-135M-Instruct, LoRA r=16 on all linear layers, fp32, beta = 0, temperature 1, one
torch thread (``--threads``; the vLLM worker gets the same), arithmetic prompts x 4 samples, exactly
``--max-new-tokens`` new tokens per completion (EOS ignored, so every step does the same work). A step is the
trainer's: make_experience (sampling, scoring, the no-grad passes: for vllm also the trainer's log-probs at sampling
time, for the mismatch) then forward/backward and the AdamW step; with vllm the next rollout first sends the
adapter (``time/sync`` is inside the generation time). Reported: medians over ``--steps`` after ``--warmup``; peak
RSS is the trainer's plus, for vllm, the peaks of the engine's processes (VmHWM of each, summed: an upper bound).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import compose, peak_rss_gb  # noqa: E402


def descendants_peak_gb() -> float:
    """Sum of the peak RSS (VmHWM) of this process's descendants (the vLLM engine core and its worker), GB."""
    children, total = {os.getpid()}, 0
    procs = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                procs[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    grew = True
    while grew:
        new = {p for p, parent in procs.items() if parent in children and p not in children}
        children |= new
        grew = bool(new)
    for pid in children - {os.getpid()}:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024 ** 2


def bench(args) -> dict:
    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.scoring import TextScorer
    from prefzoo.training.build import build_policy
    from prefzoo.training.setup import build_reward, task_prompts
    from prefzoo.training.step import accumulate_gradients
    from prefzoo.types import ROLLOUT_SEED_COLUMN, SamplingParams

    cfg = compose(["algo=grpo", "model=smollm2", "objective.beta=0", f"algo.num_samples={args.generations}",
                   f"model.lora.r={args.lora_r}", f"model.lora.alpha={2 * args.lora_r}", "trainer.device=cpu",
                   f"trainer.num_threads={args.threads}", f"rollout.engine={args.engine}",
                   f"rollout.max_new_tokens={args.max_new_tokens}"])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    algo = get_algorithm("grpo")(cfg.algo, resolve_objective(cfg), sampling)
    tok = load_tokenizer(cfg.model.name)
    t0 = time.perf_counter()
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    build_seconds = time.perf_counter() - t0
    policy = built.policy
    policy.eos_token_ids = [-1]  # never stop early: every step generates exactly max_new_tokens
    train, _ = task_prompts(cfg, tok)
    scorer = TextScorer(tok, build_reward(cfg), policy.pad_id)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    rows = []
    for i in range(args.warmup + args.steps):
        prompts = train.batch(list(range(i * args.prompts, (i + 1) * args.prompts)), policy.pad_id)
        prompts.columns[ROLLOUT_SEED_COLUMN] = [1000 * i + j for j in range(args.prompts)]
        t0 = time.perf_counter()
        exp, m = algo.make_experience(policy, prompts, scorer)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, policy, exp, args.prompts * args.generations)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        t2 = time.perf_counter()
        rows.append({"step": t2 - t0, "generation": m["time/generation"], "no_grad_passes": m["time/scoring_and_ref"],
                     "train": t2 - t1, "gen_tok_s": m["generated_tokens_per_second"],
                     "tokens": int(exp.completion_mask.sum()),
                     "diff_mean": m.get("engine/logp_diff_mean", float("nan")),
                     "diff_max": m.get("engine/logp_diff_max", float("nan"))})
        print(f"# step {i}: " + ", ".join(f"{k} {v:.4g}" for k, v in rows[-1].items()), flush=True)
    timed = rows[args.warmup:]
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    med["diff_max"] = max(r["diff_max"] for r in rows)
    engine_start = getattr(policy.engine, "start_seconds", 0.0)
    out = {"engine": args.engine, **med, "share": med["generation"] / med["step"], "build_s": build_seconds,
           "engine_start_s": engine_start, "trainer_rss_gb": peak_rss_gb(), "engine_rss_gb": descendants_peak_gb()}
    policy.engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], required=True)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = bench(args)
    print(f"# torch {torch.__version__}, {args.threads} thread(s); SmolLM2-135M, LoRA r={args.lora_r}, fp32, "
          f"{args.prompts} prompts x {args.generations} x {args.max_new_tokens} tokens")
    print("| engine | step (s) | generation (s) | generation share | no-grad passes (s) | training (s) | gen tok/s "
          "| peak RSS trainer + engine (GB) | engine start (s) | logp diff mean / max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {r['engine']} | {r['step']:.2f} | {r['generation']:.2f} | {r['share']:.0%} | {r['no_grad_passes']:.2f} | "
          f"{r['train']:.2f} | {r['gen_tok_s']:.0f} | {r['trainer_rss_gb']:.2f} + {r['engine_rss_gb']:.2f} | "
          f"{r['engine_start_s']:.0f} | {r['diff_mean']:.1e} / {r['diff_max']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
