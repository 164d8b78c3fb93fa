"""bf16 against float32 on the real model: one DPO and one GRPO step's loss, log-probs and LoRA gradients.

    .venv/bin/python bench/check_bf16.py                  # SmolLM2-135M-Instruct, 1 thread, about 3 minutes
    .venv/bin/python bench/check_bf16.py --model tiny     # the tiny random Llama: seconds

The same measurement as ``tests/training/test_bf16.py`` (whose docstring derives the theory), on SmolLM2-135M with
the benchmarks' LoRA (r=16, alpha=32, all linear layers): for each bf16 mode -- ``autocast``
(``model.compute_dtype=bfloat16``: float32 weights, autocast forwards) and ``bf16`` (``model.dtype=bfloat16``: frozen
base weights in bf16, LoRA float32) -- against the float32 run on the same weights, LoRA matrices and rows:

* log-probs: the largest per-token error of the policy's and the reference's log-probs, in units of that token's
  logit spread s_t = std over the vocabulary of the float32 logits;
* log-ratios r = logps - ref_logps: ||dr|| / sqrt(sum_t s_t^2 + s_ref,t^2);
* loss: |dL| / sqrt(sum_t (dL/dr_t)^2 (s_t^2 + s_ref,t^2)), and |dL| / |L| (not bounded by the theory);
* LoRA gradients: ||g - g_fp32|| / ||g_fp32||.

The theory's standard deviations (bf16's unit roundoff u = 2^-8 over M roundings, u sqrt(M / 3); about 19 roundings
per decoder layer) are printed beside them: for SmolLM2's 30 layers sigma_f = u sqrt(574 / 3) = 5.4e-2 for the
first three, sigma_g = u sqrt(1148 / 3) = 7.6e-2 for the gradients. Rows: 2 of the benchmarks' preference pairs
(prompts ~100 tokens, completions ~118); DPO on them; GRPO (beta 0.04, k3 as a loss) on their 4 completions as 2
groups of 2 with advantages +1/-1. The LoRA matrices are drawn from a fixed seed (A ~ N(0, 1/in), B ~ N(0, b^2),
``--lora-b-std``), the same in every run, so the policy differs from its reference (log-ratios of order 0.1-1
nat per token) and both A and B have gradients.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

U = 2.0 ** -8
MODES = {"fp32": [], "autocast": ["model.compute_dtype=bfloat16"], "bf16": ["model.dtype=bfloat16"]}
LAYER_ROUNDINGS = 19


def build(algo_name: str, mode: str, args):
    import torch
    from common import compose

    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy
    from prefzoo.types import SamplingParams

    overrides = [f"algo={algo_name}", f"model={args.model}", "model.lora.r=16", "model.lora.alpha=32",
                 "model.lora.dropout=0.0", "model.lora.target_modules=all-linear", *MODES[mode]]
    if algo_name == "grpo":
        overrides += ["objective.beta=0.04", "algo.num_samples=2"]
    cfg = compose(overrides)
    algo = get_algorithm(algo_name)(cfg.algo, resolve_objective(cfg), SamplingParams(max_new_tokens=8))
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, torch.device("cpu"))
    with torch.no_grad():
        for n, p in sorted(built.model.named_parameters()):
            if "lora_" in n:
                g = torch.Generator().manual_seed(sum(map(ord, n)))
                std = 1 / math.sqrt(p.shape[1]) if "lora_A" in n else args.lora_b_std
                p.copy_(std * torch.randn(p.shape, generator=g))
    return algo, built, tok


def batch_for(algo_name: str, built, tok):
    import torch
    from common import example_pairs

    from prefzoo.data.preference import collate_preferences
    from prefzoo.types import Experience

    examples = example_pairs(tok, 2, 256)
    pairs = collate_preferences(examples, [0, 1], built.policy.pad_id)
    if algo_name == "dpo":
        return pairs
    rows = pairs.stacked()  # chosen 0, chosen 1, rejected 0, rejected 1
    order = torch.tensor([0, 2, 1, 3])  # groups: (chosen 0, rejected 0), (chosen 1, rejected 1)
    rows = rows.select(order)
    with torch.no_grad():
        ref = built.policy.ref_logps(rows)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * rows.completion_mask
    return Experience.from_samples(rows, rewards=torch.zeros(4), advantages=advantages, loss_mask=rows.completion_mask,
                                   old_logps=None, ref_logps=ref)


def one_step(algo_name: str, mode: str, args):
    """(loss, LoRA gradients, policy log-probs, reference log-probs, dL/dref or None, the rows, built)."""
    import torch

    from prefzoo.training.step import accumulate_gradients
    from prefzoo.types import Experience

    algo, built, tok = build(algo_name, mode, args)
    batch = batch_for(algo_name, built, tok)
    policy, pol, ref = built.policy, [], []
    logps, ref_logps, loss_of = policy.logps, policy.ref_logps, algo.loss

    def keep_ref(x):
        x = x.detach().requires_grad_(True)
        x.retain_grad()
        ref.append(x)
        return x

    def keep_logps(rows, *a, **k):
        out = logps(rows, *a, **k)
        pol.append((out[0], rows))
        return out

    def loss(policy_, micro, step):
        if isinstance(micro, Experience) and micro.ref_logps is not None:
            micro.ref_logps = keep_ref(micro.ref_logps)
        return loss_of(policy_, micro, step)

    policy.logps, policy.ref_logps, algo.loss = keep_logps, lambda *a, **k: keep_ref(ref_logps(*a, **k)), loss
    t0 = time.perf_counter()
    value = accumulate_gradients(algo, policy, batch, len(batch))["loss"][0]
    seconds = time.perf_counter() - t0
    params = sorted((n, p) for n, p in built.model.named_parameters() if p.requires_grad)
    dtypes = {p.dtype for _, p in params}
    grads = torch.cat([p.grad.double().flatten() for _, p in params])
    dref = ref[0].grad.double() if ref[0].grad is not None else None
    return dict(loss=value, grads=grads, x=pol[0][0].detach().double(), ref=ref[0].detach().double(), dref=dref,
                rows=pol[0][1], built=built, seconds=seconds, dtypes=dtypes,
                base_dtypes={p.dtype for p in built.model.parameters() if not p.requires_grad})


def logit_spread(built, rows):
    import torch

    from prefzoo.models.policy import completion_logits

    with torch.no_grad():
        s = completion_logits(built.model, rows).double().std(-1)
        with built.policy.reference.context():
            s_ref = completion_logits(built.model, rows).double().std(-1)
    return s, s_ref


def compare(algo_name: str, ref32: dict, spread, run: dict) -> dict:
    import torch

    mask = ref32["rows"].completion_mask
    s, s_ref = spread
    lp = max(float(((a - b).abs() / sc)[mask].max()) for a, b, sc in
             ((run["x"], ref32["x"], s), (run["ref"], ref32["ref"], s_ref)))
    r, r32 = run["x"] - run["ref"], ref32["x"] - ref32["ref"]
    both = (s ** 2 + s_ref ** 2).where(mask, 0.0)
    ratios = float((r - r32).norm() / both.sum().sqrt())
    if ref32["dref"] is not None:
        d_r = ref32["dref"]
    else:  # GRPO at ratio 1 (see tests/training/test_bf16.py)
        m = mask.double()
        d_r = 0.04 * m / (m.sum(1, keepdim=True) * m.shape[0]) * (1 - torch.exp(-r32))
    dl = abs(run["loss"] - ref32["loss"])
    grads = float((run["grads"] - ref32["grads"]).norm() / ref32["grads"].norm())
    return dict(logps=lp, log_ratios=ratios, loss=dl / float((d_r ** 2 * both).sum().sqrt()),
                loss_rel=dl / abs(ref32["loss"]), grads=grads, mean_abs_log_ratio=float(r32.abs()[mask].mean()),
                spread=float(s[mask].mean()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny")
    ap.add_argument("--algos", nargs="+", default=["dpo", "grpo"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora-b-std", type=float, default=0.005)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# bf16 vs float32, model={args.model}, {args.threads} thread(s), torch {torch.__version__}")
    for algo_name in args.algos:
        fp32 = one_step(algo_name, "fp32", args)
        n_layers = fp32["built"].model.config.num_hidden_layers
        m_f = LAYER_ROUNDINGS * n_layers + 4  # + the final norm, the output layer's input, weight and output
        sigma_f, sigma_g = U * math.sqrt(m_f / 3), U * math.sqrt(2 * m_f / 3)
        spread = logit_spread(fp32["built"], fp32["rows"])
        print(f"{algo_name}: fp32 loss {fp32['loss']:.6f} ({fp32['seconds']:.1f} s); {n_layers} layers: theory "
              f"sigma_f = {sigma_f:.1e}, sigma_g = {sigma_g:.1e}")
        del fp32["built"]
        gc.collect()
        for mode in ("autocast", "bf16"):
            run = one_step(algo_name, mode, args)
            c = compare(algo_name, fp32, spread, run)
            print(f"  {mode:8s} loss {run['loss']:.6f} ({run['seconds']:.1f} s); trained "
                  f"{sorted(map(str, run['dtypes']))}, frozen {sorted(map(str, run['base_dtypes']))}")
            print(f"           log-probs {c['logps']:.2e} (max, units of s_t; mean s_t {c['spread']:.2f}), log-ratios "
                  f"{c['log_ratios']:.2e} (mean |r| {c['mean_abs_log_ratio']:.3f} nat), loss {c['loss']:.2e} "
                  f"(relative {c['loss_rel']:.2e}), LoRA gradients {c['grads']:.2e}")
            del run
            gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
