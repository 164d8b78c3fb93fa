"""Benchmark one PPO step on the real model: where the time goes, and the peak memory.

    .venv/bin/python bench/bench_ppo.py                       # SmolLM2-135M, LoRA r=16 alpha=32 all-linear, fp32
    .venv/bin/python bench/bench_ppo.py --steps 5 --reward arithmetic --max-new-tokens 48

A PPO step (prefzoo.algos.ppo) is split into

* rollout     sampling the completions (prefzoo.rollout, KV cache, one token per row per decode step);
* scoring     decoding them and calling the reward function (VADER, the arithmetic verifier, or a reward model);
* forwards    log pi_old (with entropy), log pi_ref (adapter switched off) and V_old (the value adapter),
              no gradients;
* update      ``algo.epochs`` passes of policy + value forward/backward and the optimizer steps.

The numbers are the mean and standard deviation over the measured steps (after ``--warmup`` steps), from the
loop's own timers (``time/generation``, ``time/scoring``, ``time/old_ref_values``, ``time/update``). Peak RSS
is the process's ``ru_maxrss`` (Linux: KiB) at the end, model loading included. The reward is VADER by default:
its scoring cost is near zero, so ``--reward model --reward-path <rm run>`` measures a learned reward instead.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from prefzoo.cli import register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_typed(hydra_compose(config_name="config", overrides=overrides))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--reward", default="sentiment", help="sentiment | arithmetic | model")
    ap.add_argument("--reward-path", default=None, help="with --reward model: the algo=rm run folder")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts per step (one completion each)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=4, help="PPO epochs per rollout")
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--run-dir", default="/tmp/prefzoo_bench_ppo")
    args = ap.parse_args()

    import torch

    from prefzoo.training.loop import Trainer

    overrides = ["algo=ppo", f"model={args.model}" if args.model in ("smollm2", "tiny") else f"model.name={args.model}",
                 f"reward={args.reward}", "model.lora.r=16", "model.lora.alpha=32", "model.lora.target_modules=all-linear",
                 "model.dtype=float32", f"trainer.batch_size={args.batch_size}",
                 f"trainer.micro_batch_size={args.micro_batch_size}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"algo.epochs={args.epochs}", f"algo.num_minibatches={args.minibatches}",
                 f"trainer.max_steps={args.steps + args.warmup}", f"trainer.num_threads={args.threads}",
                 f"trainer.device={args.device}", "trainer.progress=false", "trainer.tensorboard=false",
                 "eval.before=false", "eval.after=false"]
    if args.reward_path:
        overrides.append(f"reward.path={args.reward_path}")
    cfg = compose(overrides)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, Path(args.run_dir))
    setup_s = time.perf_counter() - t0
    rows = []
    for step in range(args.steps + args.warmup):
        m = trainer.train_step()
        if step >= args.warmup:
            rows.append(m)

    def stat(key):
        xs = [r[key] for r in rows]
        return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

    parts = [("rollout (sampling)", "time/generation"), ("scoring", "time/scoring"),
             ("forwards old/ref/value", "time/old_ref_values"), ("update (epochs x fwd/bwd)", "time/update"),
             ("step total", "time/step")]
    total = stat("time/step")[0]
    print(f"\nPPO step, {cfg.model.name} fp32 LoRA r=16 alpha=32 all-linear, reward={args.reward}, "
          f"{args.batch_size} prompts x 1 sample, max_new_tokens={args.max_new_tokens}, epochs={args.epochs}, "
          f"minibatches={args.minibatches}, threads={torch.get_num_threads()}, device={trainer.device}")
    print(f"measured steps: {len(rows)} (after {args.warmup} warm-up); setup (load) {setup_s:.1f} s; "
          f"{platform.processor() or platform.machine()}")
    print(f"{'part':28s} {'mean s':>8s} {'sd s':>7s} {'share':>6s}")
    for name, key in parts:
        mean, sd = stat(key)
        print(f"{name:28s} {mean:8.2f} {sd:7.2f} {mean / total:6.0%}")
    length = stat("completion_length")[0]
    print(f"{'completion length (tokens)':28s} {length:8.1f}")
    print(f"{'generated tokens/s':28s} {stat('generated_tokens_per_second')[0]:8.1f}")
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{'peak RSS (MiB)':28s} {rss_mib:8.0f}")
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        print(f"{'peak CUDA memory (MiB)':28s} {torch.cuda.max_memory_allocated() / 2**20:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
