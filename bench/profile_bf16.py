"""Where a bf16 step's matrix multiplications run: FLOPs by dtype and by part (body / output layer), on the real model.

    .venv/bin/python bench/profile_bf16.py                 # SmolLM2-135M-Instruct, model.dtype=bfloat16: a DPO and a GRPO step
    .venv/bin/python bench/profile_bf16.py --model tiny    # the tiny random Llama: seconds
    .venv/bin/python bench/profile_bf16.py --mode autocast # model.compute_dtype=bfloat16 (float32 weights, autocast)

A step's speed on hardware with bf16 units depends on how much of its matmul work runs in bf16: on the AMD EPYC of
issue 49 a bf16 matmul ran at 2,237 GFLOP/s against 343 in float32 (2 threads), so every float32 FLOP left in a "bf16"
step costs about 6.5 bf16 FLOPs of time. This counts, with a ``TorchDispatchMode`` over every aten matmul that
``torch.utils.flop_counter`` knows (mm, addmm, bmm, baddbmm: 2 m n k each) and ``aten.linear`` (which reaches the
dispatcher undecomposed under inference mode: the reference pass), the FLOPs of one DPO step and one GRPO
update (the batch of ``check_bf16.py``: 2 preference pairs, prompts ~100 tokens, completions ~118), split by the
dtype the matmul ran in and by part: ``head`` = a matmul with the vocabulary (V) as one of its dimensions (the output
layer, forward and backward), ``body`` = the rest (the decoder and LoRA). Attention's fused kernels are not counted
(not in the registry on CPU; under 5% of these steps' FLOPs at 256 tokens). The counts do not depend on the machine:
they are what a bf16 machine would run. Wall time is printed too, but on a CPU without bf16 units (``native_bf16``
False) bf16 is emulated and the time says nothing about bf16 hardware.

The ``float32-equivalent time`` column weighs each FLOP by the issue's measured peaks (bf16 2,237, float32 343
GFLOP/s): an estimate of how the step's matmul time splits on that machine, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

PEAKS = {"torch.bfloat16": 2237.0, "torch.float16": 2237.0, "torch.float32": 343.0}  # GFLOP/s, issue 49's EPYC


class MatmulFlops:
    """Context manager: tallies matmul FLOPs by (part, dtype) while active. ``vocab`` marks the output layer."""

    def __init__(self, vocab: int):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        self.vocab, self.flops = vocab, defaultdict(float)
        tally = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                import torch

                count = flop_registry.get(func._overloadpacket)
                if count is not None or func._overloadpacket is torch.ops.aten.linear:
                    mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
                    part = "head" if any(tally.vocab in a.shape for a in mats) else "body"
                    if count is not None:
                        flops = count(*args, **kwargs, out_val=out)
                    else:  # aten.linear reaches the dispatcher whole where no autograd is recorded (inference mode)
                        flops = 2 * args[0].numel() * args[1].shape[0]
                    tally.flops[(part, str(mats[-1].dtype))] += flops
                return out

        self.mode = _Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def table(name: str, flops: dict, seconds: float) -> list[str]:
    total = sum(flops.values())
    est = {k: v / 1e9 / PEAKS.get(k[1], 343.0) for k, v in flops.items()}
    est_total = sum(est.values())
    lines = [f"\n{name}: {total / 1e9:.2f} GFLOP of matmuls, wall {seconds:.2f} s on this machine",
             "| part | dtype | GFLOP | share of FLOPs | est. share of matmul time on issue 49's EPYC |",
             "|---|---|---|---|---|"]
    for k in sorted(flops, key=lambda k: -flops[k]):
        lines.append(f"| {k[0]} | {k[1].replace('torch.', '')} | {flops[k] / 1e9:.2f} | {flops[k] / total:.1%} | "
                     f"{est[k] / est_total:.1%} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    ap.add_argument("--mode", default="bf16", choices=["bf16", "autocast", "fp32"],
                    help="bf16 = model.dtype=bfloat16 (default); autocast = model.compute_dtype=bfloat16; fp32")
    ap.add_argument("--lora-b-std", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from check_bf16 import batch_for, build

    from prefzoo.models.precision import native_bf16
    from prefzoo.training.step import accumulate_gradients

    print(f"native bf16 on this device: {native_bf16(torch.device('cpu'))}; threads {torch.get_num_threads()}")
    out = []
    for algo_name in ("dpo", "grpo"):
        algo, built, tok = build(algo_name, args.mode, args)
        batch = batch_for(algo_name, built, tok)
        vocab = built.model.get_output_embeddings().weight.shape[0]
        accumulate_gradients(algo, built.policy, batch, len(batch))  # warm-up (allocations, oneDNN primitives)
        built.model.zero_grad(set_to_none=True)
        with MatmulFlops(vocab) as tally:
            t0 = time.perf_counter()
            accumulate_gradients(algo, built.policy, batch, len(batch))
            seconds = time.perf_counter() - t0
        what = "DPO step (policy forward + backward, reference forward)" if algo_name == "dpo" else \
            "GRPO update (policy forward + backward; reference log-probs precomputed)"
        out += table(f"{what}, {args.model}, mode {args.mode}", tally.flops, seconds)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
