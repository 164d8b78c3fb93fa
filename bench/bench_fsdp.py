"""Per-process memory of parameters, gradients and AdamW state under FSDP2 against one unsharded process (issue 31).

    .venv/bin/python bench/bench_fsdp.py                        # tiny and SmolLM2-135M, full fine-tuning and LoRA
    .venv/bin/python bench/bench_fsdp.py --models tiny --modes full --processes 1 2

Each (model, mode, processes) runs in its own ``torchrun --standalone --nproc_per_node N`` launch (gloo, one thread
per process): the model prefzoo loads (``prefzoo.models.loading.load_causal_lm``), LoRA r 16 on every linear layer
(``--modes lora``) or every weight trained (``full``), sharded with prefzoo's own :func:`prefzoo.training.fsdp.shard`
when N > 1 (the decoder layers; embeddings, final norm and output layer whole on every process), then 3 steps of
causal-LM loss on 2 rows x 128 random tokens, AdamW, the replicated gradients averaged as the trainer does. Reported
per process (process 0; the others hold the same to a shard's rounding): the bytes of its parameters, of its
gradients and of its optimizer state (each tensor's LOCAL shard for a DTensor), their sum, the ratio of that sum to
one process's, the median step time and the peak RSS (which counts the model loading, the Python runtime and the
transient all-gathered layers too, so it falls by less than the sum).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def local_bytes(tensors) -> int:
    from prefzoo.training.fsdp import is_sharded

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if is_sharded(t) else t
        total += t.numel() * t.element_size()
    return total


def worker(model_name: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from prefzoo.models.loading import load_causal_lm, load_tokenizer
    from prefzoo.training.fsdp import all_reduce_replicated_grads, clip_grad_norm, shard

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    tok = load_tokenizer(model_name)
    model = load_causal_lm(model_name, dtype="float32", tokenizer=tok)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    if world > 1:
        shard([model])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tok), (2, 128), generator=g)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        half = ids[dist.get_rank()::world] if world > 1 else ids
        loss = model(input_ids=half, labels=half).loss * world
        loss.backward()
        if world > 1:
            all_reduce_replicated_grads(params, world)
            clip_grad_norm(params, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    out = {"model": model_name, "mode": mode, "processes": world,
           "parameters": local_bytes(model.parameters()), "gradients": local_bytes(p.grad for p in params),
           "optimizer": local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()),
           "step_s": statistics.median(times), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if world == 1 or dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def launch(model_name: str, mode: str, n: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(n),
           str(Path(__file__).resolve()), "--worker", model_name, mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line and not line.startswith(" ")]
        raise SystemExit(f"{model_name} {mode} x{n} failed: {(errors or proc.stderr.strip().splitlines())[-1]}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"))
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    ap.add_argument("--modes", nargs="+", default=["full", "lora"])
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    mb = 1024 ** 2
    print("| model | training | processes | parameters MB | gradients MB | AdamW state MB | sum MB | vs 1 process | step s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model_name in args.models:
        for mode in args.modes:
            base = None
            for n in args.processes:
                r = launch(model_name, mode, n)
                total = r["parameters"] + r["gradients"] + r["optimizer"]
                base = base or total
                print(f"| {model_name} | {mode} | {n} | {r['parameters'] / mb:.1f} | {r['gradients'] / mb:.1f} | "
                      f"{r['optimizer'] / mb:.1f} | {total / mb:.1f} | {total / base:.2f} | {r['step_s']:.2f} | "
                      f"{r['peak_rss'] / mb:.0f} |", flush=True)
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
