"""Golden runs: record tiny runs of every algorithm and of the loop's capabilities, then check that a change of the
code left every one of them the same (the behaviour-preserving redesign of issue 47).

    python bench/golden_runs.py record OUT        # run every case below into OUT/<case>/ (about 15 min on 2 cores)
    python bench/golden_runs.py compare OUT NEW   # run them again into NEW/ and compare with OUT; exit 1 on a change
    python bench/golden_runs.py diff OUT NEW      # compare two recorded folders without running anything
    python bench/golden_runs.py ... --only grpo,ppo

Each case is ``python train.py model=tiny trainer.max_steps=2`` with the held-out evaluation on (before and after), one
torch thread per process, in a folder of its own. What is compared: every line of ``metrics.jsonl`` and the whole of
``summary.json``, field by field and EXACTLY (same machine, same thread count: the same float operations give the
same bits), except the fields that measure time or name the folder (:func:`comparable`). A case that uses two
processes (DDP, FSDP2) runs under ``torchrun --standalone --nproc_per_node 2``.

This is a regression harness, not a test of any formula: equality says the refactored code does the same arithmetic in
the same order, which is what a behaviour-preserving redesign promises; it says nothing about whether that arithmetic
is right (the formula tests do).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = str(ROOT / "tests/fixtures/arithmetic_pairs.jsonl")

COMMON = ["model=tiny", "trainer.max_steps=2", "trainer.device=cpu", "trainer.num_threads=1", "trainer.progress=false",
          "trainer.tensorboard=false", "trainer.save_every=1", "model.lora.r=4", "eval.before=true", "eval.after=true",
          "eval.num_problems=4", "eval.max_new_tokens=6", "eval.diversity_prompts=2", "eval.diversity_samples=2",
          "eval.batch_size=4", "eval.reuse_before=false", "trainer.seed=3"]
ONLINE = ["data=arithmetic", "data.num_train=16", "data.num_eval=4", "rollout.max_new_tokens=8",
          "trainer.batch_size=2", "reward.functions=[tests.algos.hydra_runs:letter_share]"]
OFFLINE = ["data=file", f"data.path={FIXTURE}", "data.max_length=96", "data.max_prompt_length=64", "trainer.batch_size=2"]

#: case name -> (overrides, processes). The teacher of ``distill`` is the ``sft`` case's run folder (recorded first).
CASES: dict[str, tuple[list[str], int]] = {
    **{algo: ([f"algo={algo}", *OFFLINE], 1) for algo in ("rpo", "dpo", "simpo", "orpo", "sft", "kto", "rm")},
    **{algo: ([f"algo={algo}", *ONLINE], 1)
       for algo in ("grpo", "ppo", "rloo", "reinforce_pp", "gspo", "cispo", "online_dpo", "bon")},
    "distill": (["algo=distill", "algo.teacher={out}/sft", *ONLINE], 1),
    "distill_teacher_reward": (["algo=teacher_reward", "algo.teacher={out}/sft", *ONLINE], 1),
    "grpo_beta": (["algo=grpo", "objective.beta=0.04", "algo.epochs=2", *ONLINE], 1),
    "env_retry": (["algo=grpo", "env=retry", *ONLINE], 1),
    "env_calculator": (["algo=grpo", "env=calculator", *ONLINE], 1),
    "async": (["algo=grpo", "rollout.asynchronous=true", *ONLINE], 1),
    "sequence_mask": (["algo=grpo", "rollout.correction.mode=sequence_mask", "rollout.log_mismatch=true",
                       "rollout.top_p=0.8", "rollout.top_k=20", *ONLINE], 1),
    "dynamic_sampling": (["algo=grpo", "algo.dynamic_sampling=true", *ONLINE], 1),
    "ddp_dpo": (["algo=dpo", *[o for o in OFFLINE if not o.startswith("trainer.batch_size")],
                 "trainer.batch_size=4"], 2),
    "ddp_grpo": (["algo=grpo", *[o for o in ONLINE if not o.startswith("trainer.batch_size")],
                  "trainer.batch_size=4"], 2),
    "fsdp_grpo": (["algo=grpo", "trainer.fsdp=true", "model.fast.merged_rollout=false",
                   *[o for o in ONLINE if not o.startswith("trainer.batch_size")], "trainer.batch_size=4"], 2),
}

#: fields that measure time, speed or where things are: not compared
TIMING_WORDS = ("time/", "seconds", "per_second", "tokens_per_s")
PATH_KEYS = {"weights", "reused_from", "run_dir"}


def comparable(value, out: str):
    """``value`` with the timing fields dropped (at any depth) and the output folder's path replaced by ``<out>``."""
    if isinstance(value, dict):
        return {k: comparable(v, out) for k, v in value.items()
                if not any(w in k for w in TIMING_WORDS) and k not in PATH_KEYS}
    if isinstance(value, list):
        return [comparable(v, out) for v in value]
    if isinstance(value, str):
        return value.replace(out, "<out>")
    return value


def read_run(folder: Path, out: Path) -> dict:
    metrics = folder / "metrics.jsonl"
    summary = folder / "summary.json"
    return {"metrics": [comparable(json.loads(line), str(out)) for line in metrics.read_text().splitlines()]
            if metrics.is_file() else None,
            "summary": comparable(json.loads(summary.read_text()), str(out)) if summary.is_file() else None}


def differences(a, b, where: str = "") -> list[str]:
    """Every place where two JSON values differ (NaN equals NaN)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}/{k}: only in {'the new' if k in b else 'the recorded'} run")
            else:
                out += differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items recorded, {len(b)} now"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} recorded, {b!r} now"]


def run_case(name: str, out: Path) -> tuple[int, float]:
    overrides, processes = CASES[name]
    overrides = [o.replace("{out}", str(out)) for o in overrides]
    folder = out / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0",
           "PYTHONPATH": str(ROOT)}
    launch = ([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(processes)]
              if processes > 1 else [sys.executable])
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run([*launch, str(ROOT / "train.py"), *COMMON, *overrides, f"hydra.run.dir={folder}"],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    return code, time.perf_counter() - start


def record(out: Path, names: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in names:
        code, seconds = run_case(name, out)
        print(f"{name:24s} exit {code}  {seconds:6.1f} s", flush=True)
        failed += code != 0
    return 1 if failed else 0


def diff(recorded: Path, new: Path, names: list[str]) -> int:
    changed = missing = 0
    for name in names:
        a, b = read_run(recorded / name, recorded), read_run(new / name, new)
        if a["summary"] is None:
            missing += 1
            print(f"{name:24s} (not recorded)")
            continue
        if b["summary"] is None or (b["metrics"] is None) != (a["metrics"] is None):
            changed += 1
            print(f"{name:24s} the new run wrote no summary.json or metrics.jsonl (see {new / name}.log)")
            continue
        found = differences(a, b)
        changed += bool(found)
        print(f"{name:24s} {'same' if not found else f'{len(found)} differences'}")
        for line in found[:12]:
            print(f"    {line}")
    compared = len(names) - missing
    print(f"{compared - changed} of {compared} runs identical (timing fields aside)"
          + (f"; {missing} not recorded" if missing else ""))
    return 1 if changed or missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("record", "compare", "diff"))
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--only", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    folders = [f.resolve() for f in args.folders]
    if args.command == "record":
        return record(folders[0], names)
    if len(folders) != 2:
        parser.error(f"{args.command} needs two folders: the recorded runs and the new ones")
    if args.command == "compare":
        record(folders[1], names)
    return diff(folders[0], folders[1], names)


if __name__ == "__main__":
    sys.exit(main())
