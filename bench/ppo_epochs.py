"""PPO's epochs per rollout, chosen by measurement: reward against wall-clock time for 1, 2 and 4 epochs.

    .venv/bin/python bench/ppo_epochs.py                                  # SmolLM2-135M, sentiment, 1/2/4 epochs
    .venv/bin/python bench/ppo_epochs.py --model tiny --runs 4:2 1:3      # a smoke test of the script itself

Each entry ``E:S`` of ``--runs`` is one training run, ``python train.py algo=ppo algo.epochs=E
trainer.max_steps=S`` (the same seed, prompts, reward and everything else; ``--overrides`` adds more), one after
the other, so every run has the machine to itself. S is chosen so the runs take about the same time (an epoch is
most of a PPO step; the defaults assume ~30 s, ~20 s and ~13 s a step for 4, 2 and 1 epochs at 8 prompts x 48
tokens on this 2-core CPU). From each run's ``metrics.jsonl``: the cumulative step time (``time/step``, the
training loop's own timer, model loading and evaluation excluded) and the rollout reward of each step. Printed: per
run the steps, seconds per step, the mean reward of its first and last ``--window`` steps, the KL (k1, nats per
sequence) of its last steps, and the mean reward of its last ``--window`` steps that ended within the time every
run reached (the matched-time comparison); ``ppo_epochs.png`` plots the reward (running mean over ``--window``
steps) against time; with ``--overrides eval.after=true`` (the runs' held-out evaluation, e.g. on arithmetic) the table
adds each run's accuracy after training, the matched-time comparison with a standard error. One seed: read differences smaller than the step-to-step noise (``reward_std`` / sqrt(batch))
as ties.
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


def read(run: Path) -> list[dict]:
    """The per-step rows of a run's metrics.jsonl (evaluation rows, which have no ``time/step``, dropped)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "time/step" in r]


def running_mean(xs: list[float], k: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=["4:14", "2:21", "1:32"], help="EPOCHS:STEPS entries")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--reward", default="sentiment")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--window", type=int, default=4, help="steps in the running mean")
    ap.add_argument("--overrides", nargs="*", default=[], help="more Hydra overrides for every run")
    ap.add_argument("--out", default="/tmp/prefzoo_ppo_epochs")
    ap.add_argument("--reuse", action="store_true", help="read the runs already in --out instead of training")
    args = ap.parse_args()
    out = Path(args.out)
    results = {}
    for entry in args.runs:
        epochs, steps = (int(x) for x in entry.split(":"))
        run = out / f"epochs-{epochs}"
        if not args.reuse:
            cmd = [sys.executable, str(ROOT / "train.py"), "algo=ppo", f"model={args.model}", f"reward={args.reward}",
                   f"algo.epochs={epochs}", f"trainer.max_steps={steps}", f"trainer.batch_size={args.batch_size}",
                   f"rollout.max_new_tokens={args.max_new_tokens}", f"trainer.num_threads={args.threads}",
                   "eval.before=false", "eval.after=false", "trainer.save_every=0", "trainer.progress=false",
                   f"hydra.run.dir={run}", *args.overrides]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or [str(proc.returncode)]
                print(f"epochs={epochs}: failed: {tail[0]}")
                continue
        rows = read(run)
        times, t = [], 0.0
        for r in rows:
            t += r["time/step"]
            times.append(t)
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        after = summary.get("eval_after") or {}
        accuracy = (f"{after['task_accuracy']:.3f} ± {after.get('task_accuracy_se', float('nan')):.3f}"
                    if "task_accuracy" in after else "–")
        results[epochs] = (times, [r["reward"] for r in rows], [r.get("kl", float("nan")) for r in rows], accuracy)
    if not results:
        return 1
    horizon = min(times[-1] for times, *_ in results.values())
    w = args.window
    print(f"# PPO on {args.model}, reward={args.reward}, {args.batch_size} prompts x {args.max_new_tokens} new tokens "
          f"per step; matched time = {horizon:.0f} s (the shortest run)")
    print("| epochs | steps | s / step | reward, first steps | reward, last steps | KL k1, last steps | "
          "reward at matched time | held-out accuracy after |")
    print("|---|---|---|---|---|---|---|---|")
    for epochs, (times, rewards, kls, accuracy) in sorted(results.items()):
        late = [r for t, r in zip(times, rewards) if t <= horizon * (1 + 1e-9)][-w:]
        print(f"| {epochs} | {len(rewards)} | {times[-1] / len(rewards):.1f} | {statistics.fmean(rewards[:w]):.3f} | "
              f"{statistics.fmean(rewards[-w:]):.3f} | {statistics.fmean(kls[-w:]):.2f} | "
              f"{statistics.fmean(late) if late else float('nan'):.3f} ({len(late)} steps) | {accuracy} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for epochs, (times, rewards, *_) in sorted(results.items()):
        ax.plot(times, running_mean(rewards, w), marker="o", ms=3, label=f"{epochs} epoch{'s' if epochs > 1 else ''}")
    ax.axvline(horizon, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training time (s, time/step summed)")
    ax.set_ylabel(f"rollout reward ({args.reward}, running mean of {w} steps)")
    ax.set_title(f"PPO epochs per rollout: reward against time ({args.model})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ppo_epochs.png", dpi=120)
    print(f"plot: {out / 'ppo_epochs.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
