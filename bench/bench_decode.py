"""Benchmark the rollout's decode step against this machine's memory-bandwidth floor.

    .venv/bin/python bench/bench_decode.py                        # B = 1, 8, 16; kv_cache static and dynamic
    .venv/bin/python bench/bench_decode.py --rows 8 --steps 32 --threads 1 --note "under load"

Setting: SmolLM2-135M-Instruct (model=smollm2), float32, the attention the trainer uses (prefzoo.models.attention),
B rows of a ~``--prompt-tokens`` real chat prompt, sampled at temperature 1 with end-of-sequence ignored, so every
rollout decodes exactly ``--steps`` tokens per row.

What is measured:

* **bandwidth**: the best of ``--repeats`` reads of a ``--bandwidth-mib`` float32 tensor (``x.sum()``, GB/s = bytes
  read / s), and of copies (``y.copy_(x)``, bytes read + written / s). A decode step streams the weights once, so the
  read figure is the one the floor uses.
* **bytes per decode step**: every parameter once (SmolLM2's output layer is its tied embedding: read whole by the
  head), plus the KV cache the attention reads at the mean length of the rollout (B x layers x 2 x H_kv x (P +
  steps / 2) x d x 4 bytes).
* **floor** = bytes per step / read bandwidth: no decode step can be faster on this machine.
* **compute floor** (for context): 2 x B x (weights of the linear layers, output layer included) FLOPs / the best
  float32 matmul rate measured here (``--matmul-size`` squared): where B rows make the step compute-bound
  instead (on 2 cores at B = 8-16, fp32), the bandwidth fraction cannot reach 1.
* **decode step**: (time of a rollout of ``--steps`` tokens - time of a rollout of 1 token) / (steps - 1), the median
  of ``--repeats``; the 1-token rollout is the prefill and one sampling, so the difference is steps - 1 decode
  forwards and their sampling. Per token = step / B.
* **floor / step**: the fraction of the bandwidth floor the loop reaches (1.0 = memory-bound at full bandwidth).

Each ``--kv-cache`` mode (``rollout.kv_cache``) is measured; ``--compile`` adds the static loop with the decode
step compiled (``rollout.compile_decode``), timing its compilation separately. Writes ``bench/results/decode.json``
(``--out``) with the settings, the load note (``--note``; also the 1-minute load average) and every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import long_prompt  # noqa: E402


def bandwidth(mib: int, repeats: int) -> dict:
    """Best read (sum) and copy bandwidth in GB/s over ``repeats`` passes of a ``mib`` MiB float32 tensor."""
    n = mib * 2 ** 20 // 4
    x = torch.ones(n)
    y = torch.empty_like(x)
    x.sum(), y.copy_(x)  # touch the pages
    reads, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        reads.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        y.copy_(x)
        copies.append(2 * x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return {"read_gb_s": max(reads), "copy_gb_s": max(copies), "tensor_mib": mib}


def matmul_gflops(size: int, repeats: int) -> float:
    """Best float32 (size x size) @ (size x size) rate in GFLOP/s over ``repeats`` products."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * size ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def linear_weights(model) -> int:
    """Weights the matmuls of one token read: every ``nn.Linear`` weight (the output layer included), once each."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() not in seen:
            seen.add(m.weight.data_ptr())
            total += m.weight.numel()
    return total


def weight_bytes(model) -> int:
    """Bytes of every distinct parameter and buffer of ``model`` (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes(config, rows: int, length: float, element_size: int = 4) -> float:
    """Bytes of keys and values attention reads at ``length`` cached positions."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rows * config.num_hidden_layers * 2 * heads * length * head_dim * element_size


def rollout_seconds(model, prompts, steps: int, kv_cache: str, compile_decode: bool) -> float:
    from prefzoo.rollout.generate import sample_completions
    from prefzoo.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=steps)
    t = time.perf_counter()
    sample_completions(model, prompts, 1, params, eos_token_ids=[-1], pad_id=0,
                       generator=torch.Generator().manual_seed(0), kv_cache=kv_cache, compile_decode=compile_decode)
    return time.perf_counter() - t


def measure(model, prompts, steps: int, repeats: int, modes: list[tuple[str, bool]]) -> list[dict]:
    """Per mode (kv_cache, compiled): the median decode-step seconds (see the module docstring) and the first
    (warm-up, compiling) rollout's time. The modes take turns within each repeat, so a load that drifts over the run
    weighs on all of them alike."""
    first = [rollout_seconds(model, prompts, steps, kv, c) for kv, c in modes]
    for kv, c in modes:
        rollout_seconds(model, prompts, 1, kv, c)
    full, one = [[] for _ in modes], [[] for _ in modes]
    for _ in range(repeats):
        for i, (kv, c) in enumerate(modes):
            full[i].append(rollout_seconds(model, prompts, steps, kv, c))
            one[i].append(rollout_seconds(model, prompts, 1, kv, c))
    out = []
    for i in range(len(modes)):
        full_s, one_s = statistics.median(full[i]), statistics.median(one[i])
        each = [(f - o) / (steps - 1) for f, o in zip(full[i], one[i])]
        out.append({"step_s": (full_s - one_s) / (steps - 1), "rollout_s": full_s, "prefill_s": one_s,
                    "first_rollout_s": first[i], "step_s_all": each})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--kv-cache", nargs="+", default=["static", "dynamic"])
    ap.add_argument("--compile", action="store_true", help="also the static loop with the decode step compiled")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument("--matmul-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--note", default="", help="load conditions, stored in the results (e.g. 'idle', 'under load')")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from prefzoo.models.attention import use_gqa_attention
    from prefzoo.models.loading import load_causal_lm, load_tokenizer
    from prefzoo.data.preference import pad_rows, prompt_text
    from prefzoo.types import PromptBatch

    tok = load_tokenizer(args.model)
    model = load_causal_lm(args.model, tokenizer=tok).eval()
    use_gqa_attention(model)
    bw = bandwidth(args.bandwidth_mib, max(args.repeats, 5))
    bw["matmul_gflop_s"] = matmul_gflops(args.matmul_size, max(args.repeats, 5))
    wbytes, n_linear = weight_bytes(model), linear_weights(model)
    print(f"bandwidth: read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s; matmul "
          f"{bw['matmul_gflop_s']:.0f} GFLOP/s; weights {wbytes / 1e6:.0f} MB; "
          f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}; note: {args.note or '-'}")
    modes = [(kv, False) for kv in args.kv_cache] + ([("static", True)] if args.compile else [])
    rows = []
    for b in args.rows:
        ids = [tok(prompt_text(tok, long_prompt(i)), add_special_tokens=False)["input_ids"][-args.prompt_tokens:]
               for i in range(b)]
        p_ids, p_mask = pad_rows(ids, "left", tok.pad_token_id)
        prompts = PromptBatch(p_ids, p_mask)
        kv = kv_bytes(model.config, b, p_ids.shape[1] + args.steps / 2)
        floor = (wbytes + kv) / (bw["read_gb_s"] * 1e9)
        flop_floor = 2 * b * n_linear / (bw["matmul_gflop_s"] * 1e9)
        for (kv_cache, compiled), m in zip(modes, measure(model, prompts, args.steps, args.repeats, modes)):
            row = {"rows": b, "kv_cache": kv_cache, "compile": compiled, "prompt_tokens": int(p_ids.shape[1]),
                   "steps": args.steps, "weight_bytes": wbytes, "kv_bytes": kv, "floor_s": floor,
                   "compute_floor_s": flop_floor, **m,
                   "token_s": m["step_s"] / b, "floor_fraction": floor / m["step_s"]}
            rows.append(row)
            print(f"B={b:>2} {kv_cache:>7}{' compiled' if compiled else ''}: step {m['step_s'] * 1e3:7.1f} ms "
                  f"({m['step_s'] / b * 1e3:6.1f} ms/token), floor {floor * 1e3:6.1f} ms, "
                  f"floor/step {floor / m['step_s']:.2f}, compute floor {flop_floor * 1e3:6.1f} ms; "
                  f"first rollout {m['first_rollout_s']:.1f} s", flush=True)
    print()
    print("| B | kv_cache | compile | step ms | ms/token | bandwidth floor ms | floor/step | compute floor ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['kv_cache']} | {'yes' if r['compile'] else 'no'} | {r['step_s'] * 1e3:.1f} | "
              f"{r['token_s'] * 1e3:.1f} | {r['floor_s'] * 1e3:.1f} | {r['floor_fraction']:.2f} | "
              f"{r['compute_floor_s'] * 1e3:.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "note": args.note, "load_average_1min": os.getloadavg()[0], "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "model": args.model, "dtype": "float32", "bandwidth": bw, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
