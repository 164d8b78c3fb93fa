"""prefzoo and TRL side by side on the same model, data, batch, lengths, LoRA and precision, one command.

    make bench-trl                                   # creates bench/.venv-trl if needed, then runs everything
    make bench-trl ARGS='--algos dpo --precisions bf16'
    TRL_PYTHON=/path/to/venv/bin/python .venv/bin/python bench/compare_trl.py   # TRL from another venv
    .venv/bin/python bench/compare_trl.py --algos dpo --steps 2 --rounds 2     # once bench/.venv-trl exists

TRL is a bench-only dependency, in its own virtual environment so prefzoo's runtime dependencies stay
untouched: ``make setup-bench-trl`` (or ``make bench-trl``) creates ``bench/.venv-trl`` with the CPU build of torch
that lies on disk first (``TORCH_SPEC``, as for prefzoo's venv: a bare ``torch`` pulls CUDA), then trl 1.16.0,
transformers 5.24.0, peft 0.21.2 (``TRL_SPEC``), the versions this comparison was made with. The environment
variable ``TRL_PYTHON`` names another interpreter with TRL instead (the default: bench/.venv-trl/bin/python).

What runs. SmolLM2-135M-Instruct (prefzoo converts it once to float safetensors under ~/.cache/prefzoo; TRL loads
that folder), LoRA r=16 alpha=32 dropout 0 on all linear layers, AdamW, gradient clipping at 1.0, in two precisions
(``--precisions``, both by default), each library against the other at the same precision:

* fp32: float32 weights and compute in both;
* bf16: TRL's ``bf16=True`` (the Trainer's autocast over its float32 weights, gradient checkpointing as its
  default) against prefzoo's two bf16 modes (:mod:`prefzoo.models.precision`): ``bf16`` = ``model.dtype=bfloat16``
  (frozen base weights stored in bf16, LoRA and its AdamW state float32) and ``autocast`` =
  ``model.compute_dtype=bfloat16`` (float32 weights, autocast forwards, as TRL). Log-probs and losses are float32
  in all of them. The ratio lines pair runs of the same precision only, and add prefzoo bf16 / prefzoo fp32.

* dpo, simpo: 4 pairs per step (prompt ~100 tokens, completions ~114-124 tokens, max_length 256: ~1,750 real
  tokens counting the prompt once per row), the same token ids in both (TRL tokenises the texts; prefzoo's worker
  builds the ids exactly as TRL's DPO trainer does). TRL: ``DPOTrainer`` (beta 0.1) and ``CPOTrainer`` with
  ``loss_type="simpo"``, ``cpo_alpha=0`` (TRL 1.x's SimPO) at prefzoo's defaults, beta 2.0 and gamma/beta 0.5, i.e.
  the target margin gamma = 1.0. TRL's ``simpo_gamma`` IS gamma (its loss is -log sigmoid(beta (avg_w - avg_l) -
  simpo_gamma), the ``gamma_logratios = simpo_gamma / beta`` it subtracts being inside the beta), so it gets
  simpo_gamma = beta x prefzoo's ``algo.gamma_beta_ratio`` = 1.0 (both read from prefzoo's SimPOConfig); an earlier
  version passed 0.5, i.e. gamma/beta 0.25 on TRL's side.
* grpo (beta 0 and 0.04): 2 arithmetic prompts x 4 generations x 64 new tokens (end-of-sequence never stops a
  row: prefzoo ignores it, TRL gets ``min_new_tokens=64``), temperature 1, the same prompts in the same order, the
  arithmetic verifier as reward. A step is rollout + scoring + no-grad passes + the update. prefzoo's fp32 variants
  beyond its defaults: ``nokl`` = ``trainer.kl_metric_every=0`` (at beta 0 prefzoo runs the reference for its ``kl``
  metric by default; TRL computes no KL at beta 0, so this is TRL's computation), and ``bf16rollout`` = that plus
  ``rollout.dtype=bfloat16`` (the sampler's merged copy in bf16, the trainer float32: the layout of a bf16 vLLM
  engine beside a float32 trainer; the samples then come from a rounded policy, see docs/off-policy.md).
* ppo: TRL 1.x has no PPO trainer; prefzoo's PPO step (8 prompts x 1 sample x 64 tokens, its default 4 epochs,
  separate value adapter) is compared with prefzoo's own GRPO step on the same rollout size (8 rows x 64 tokens).

Each measurement runs in its own process (so the peak RSS, ``ru_maxrss``, model loading included, belongs to one
library), prefzoo and TRL alternating (the order flips every round) so both see the same load from whatever else
runs on the machine; the load average is recorded around every run. Reported per run: median step wall time over
the steps after ``--warmup``, CPU time, real tokens per second, peak RSS, the FLOP lower bound of the step and the
achieved fraction of the machine's fp32 matmul peak, measured here (2048^3 matmuls, all threads, best of 5, at
the start, between algorithms and at the end: the highest figure is used, so the fraction is conservative).

FLOP lower bound (what is counted). N_body = the decoder's linear weights (q, k, v, o, gate, up, down: 106.2M on
SmolLM2-135M), N_lora = the adapter (4.9M), N_head = V x d (28.3M, tied). A forward over T real tokens (each row's
prompt counted, as a padded batch would compute it) with K positions predicting completion tokens costs
F = 2 (N_body + N_lora) T + 2 N_head K; attention scores, norms, activations are not counted. A trained pass
costs F + B with B = the backward: ``lora`` count (the floor for LoRA) B = 2 N_body T + 2 N_head K (gradients
w.r.t. activations through the frozen weights) + 4 N_lora T (the adapter's own); ``6N`` convention B = 2 F (as if
every weight trained: not a floor under LoRA, shown because it is the usual MFU convention). Reference/no-grad
passes cost F. GRPO/PPO rollouts: the prompt once (2 (N_body + N_lora) P) plus 2 (N_body + N_lora + N_head) per
generated token. The fraction of peak reported is FLOP lower bound / step time / peak. prefzoo runs rows that share
a prompt once, so it does less than this count (the bound is that of the standard computation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
TRL_PYTHON = Path(os.environ.get("TRL_PYTHON") or ROOT / "bench" / ".venv-trl" / "bin" / "python")
SETTING = dict(lora_r=16, lora_alpha=32, batch=4, max_length=256, prompts_per_step=2, generations=4, max_new_tokens=64)


# ----------------------------------------------------------------------------------------------- measurements
def matmul_peak(dtype: str = "float32", n: int = 2048, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOP/s of an n^3 matmul on all torch threads."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def load_snapshot() -> dict:
    """1-minute load average and the busiest processes that are not this benchmark."""
    out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    mine = {os.getpid()}
    busy = []
    for line in out.splitlines()[1:8]:
        pid, cpu, args = line.split(None, 2)
        if int(pid) not in mine and float(cpu) >= 10 and "compare_trl.py" not in args and "trl_worker.py" not in args:
            busy.append(f"{float(cpu):.0f}% {args[:80]}")
    return {"load1": os.getloadavg()[0], "others": busy}


def model_sizes(model_dir: str, lora_r: int) -> dict:
    """N_body, N_lora, N_head from the model's config.json (Llama-family shapes)."""
    c = json.load(open(Path(model_dir) / "config.json"))
    d, f, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]  # (in, out) of q k v o gate up down
    body = layers * sum(i * o for i, o in shapes)
    lora = layers * sum(lora_r * (i + o) for i, o in shapes)
    return {"body": body, "lora": lora, "head": c["vocab_size"] * d}


def step_flops(algo: str, n: dict, tokens: dict, beta: float = 0.0) -> dict:
    """FLOP lower bound of one step (module docstring), under the ``lora`` count and the ``6N`` convention."""
    nb, nl, nh = n["body"], n["lora"], n["head"]

    def fwd(t, k):
        return 2 * (nb + nl) * t + 2 * nh * k

    def bwd_lora(t, k):
        return 2 * nb * t + 2 * nh * k + 4 * nl * t

    t, k = tokens["real_tokens"], tokens["completion_tokens"]
    gen = 0.0
    if algo in ("grpo", "ppo"):
        gen = 2 * (nb + nl) * tokens["unique_prompt_tokens"] + 2 * (nb + nl + nh) * tokens["completion_tokens"]
    passes = {"dpo": (1, 1), "simpo": (1, 0), "grpo": (1, 1 if beta > 0 else 0), "ppo": (tokens.get("epochs", 4), 2)}
    trained, no_grad = passes[algo]
    if algo == "ppo":  # policy and value (separate adapter): 2 trained passes per epoch; old logps, ref, old values
        lora = gen + trained * 2 * (fwd(t, k) + bwd_lora(t, k)) + 3 * fwd(t, k)
        six = gen + trained * 2 * 3 * fwd(t, k) + 3 * fwd(t, k)
    else:
        lora = gen + trained * (fwd(t, k) + bwd_lora(t, k)) + no_grad * fwd(t, k)
        six = gen + trained * 3 * fwd(t, k) + no_grad * fwd(t, k)
    return {"lora": lora, "6N": six}


# ----------------------------------------------------------------------------------------------- workloads
def write_workload(path: Path, args) -> dict:
    from common import example_pair_texts

    from prefzoo.models.loading import load_tokenizer, smollm2_local_dir

    tok = load_tokenizer("smollm2")
    w = dict(SETTING, model_dir=str(smollm2_local_dir()), steps=args.steps, warmup=args.warmup,
             pairs=example_pair_texts(tok, SETTING["batch"], SETTING["max_length"]), trl_gradient_checkpointing=True)
    w["all_prompts"] = arithmetic_prompts(tok, (args.steps + args.warmup) * 8)
    w.update(simpo_settings())
    path.write_text(json.dumps(w))
    return w


def simpo_settings() -> dict:
    """SimPO's beta and target margin gamma as prefzoo runs them by default: beta = ``default_beta`` (2.0), gamma =
    beta x ``gamma_beta_ratio`` (1.0). TRL's ``simpo_gamma`` is gamma itself (module docstring)."""
    from prefzoo.algos.simpo import SimPOConfig

    c = SimPOConfig()
    return {"simpo_beta": c.default_beta, "simpo_gamma": c.default_beta * c.gamma_beta_ratio}


def arithmetic_prompts(tok, n: int) -> list[dict]:
    """The first ``n`` prompts of prefzoo's arithmetic task (its default data), as text and token ids."""
    from common import compose

    from prefzoo.training.setup import task_prompts

    cfg = compose(["algo=grpo", "model=smollm2"])
    train, _ = task_prompts(cfg, tok)
    return [{"text": train.texts[i], "ids": train.prompt_ids[i], "answer": train.columns["answer"][i]} for i in range(n)]


# ----------------------------------------------------------------------------------------------- prefzoo worker
def prefzoo_worker(workload: dict, algo: str, variant: str) -> dict:
    import torch
    from common import compose, peak_rss_gb, tokenize_pair_like_trl

    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy
    from prefzoo.training.step import accumulate_gradients

    torch.manual_seed(0)
    w = workload
    beta = w.get("beta", 0.0)
    name = {"dpo": "dpo", "simpo": "simpo", "grpo": "grpo", "ppo": "ppo", "grpo8": "grpo"}[algo]
    overrides = [f"algo={name}", "model=smollm2", f"model.lora.r={w['lora_r']}", f"model.lora.alpha={w['lora_alpha']}",
                 "model.lora.dropout=0.0", "model.lora.target_modules=all-linear", "model.dtype=float32",
                 f"data.max_length={w['max_length']}"]
    if variant == "gc":
        overrides.append("model.gradient_checkpointing=true")
    elif variant == "plain":  # every fast path off: the computation they replace
        overrides += ["model.fast.fused_logps=false", "model.fast.share_prompts=false", "model.fast.fused_lora=false",
                      "model.fast.gqa_attention=false", "model.fast.merged_rollout=false"]
    elif variant == "autocast":  # float32 weights, autocast forwards (TRL's bf16=True)
        overrides.append("model.compute_dtype=bfloat16")
    elif variant == "bf16":  # frozen base weights in bf16, LoRA and its optimizer state float32
        overrides[overrides.index("model.dtype=float32")] = "model.dtype=bfloat16"
    elif variant == "nokl":  # TRL's computation at beta 0: no reference pass for the kl metric
        overrides.append("trainer.kl_metric_every=0")
    elif variant == "bf16rollout":  # ... and the sampler's merged copy in bf16, the float32 trainer unchanged
        overrides += ["trainer.kl_metric_every=0", "rollout.dtype=bfloat16"]
    if name == "grpo":
        overrides += [f"objective.beta={beta}", f"algo.num_samples={w['generations'] if algo == 'grpo' else 4}"]
    if name == "ppo":
        overrides += ["reward=arithmetic", "algo.num_samples=1"]
    cfg = compose(overrides)
    from prefzoo.types import SamplingParams

    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=w.get("max_new_tokens", 64))
    algo_obj = get_algorithm(name)(cfg.algo, resolve_objective(cfg), sampling)
    algo_obj.drift_metrics_due = cfg.trainer.kl_metric_every == 1  # the loop's setting (no loop here), every step
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo_obj.declaration, tok, torch.device("cpu"))
    policy = built.policy
    params = [p for p in built.model.parameters() if p.requires_grad]
    if policy.value_model is not None:
        params += [p for p in policy.value_model.parameters() if p.requires_grad and not any(p is q for q in params)]
    opt = torch.optim.AdamW(params, lr=1e-5)
    wall, cpu, seen = [], [], {"real_tokens": [], "completion_tokens": [], "unique_prompt_tokens": []}
    parts: dict[str, list[float]] = {}
    total = w["steps"] + w["warmup"]
    if name in ("dpo", "simpo"):
        from prefzoo.data.preference import collate_preferences

        examples = [tokenize_pair_like_trl(tok, p) for p in w["pairs"]]
        batch = collate_preferences(examples, list(range(len(examples))), tok.pad_token_id)
        for _ in range(total):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            accumulate_gradients(algo_obj, policy, batch, len(examples))
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            seen["real_tokens"].append(batch.num_tokens())
            seen["completion_tokens"].append(int(batch.chosen.completion_mask.sum() + batch.rejected.completion_mask.sum()))
    else:
        from prefzoo.types import PromptBatch
        from prefzoo.data.preference import pad_rows
        from prefzoo.training.scoring import TextScorer
        from prefzoo.training.setup import build_reward

        policy.eos_token_ids = [-1]  # never stop early: every step generates exactly max_new_tokens per row
        scorer = TextScorer(tok, build_reward(cfg), policy.pad_id)
        per_step = len(w["prompts"]) // total
        for i in range(total):
            rows = w["prompts"][i * per_step:(i + 1) * per_step]
            ids, mask = pad_rows([r["ids"] for r in rows], "left", policy.pad_id)
            prompts = PromptBatch(ids, mask, {"answer": [r["answer"] for r in rows],
                                              "prompt_text": [r["text"] for r in rows]})
            t0, c0 = time.perf_counter(), time.process_time()
            exp, m = algo_obj.make_experience(policy, prompts, scorer)
            t1 = time.perf_counter()
            for _ in range(algo_obj.declaration.epochs):
                opt.zero_grad(set_to_none=True)
                accumulate_gradients(algo_obj, policy, exp, len(exp))
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
            t2 = time.perf_counter()
            wall.append(t2 - t0)
            cpu.append(time.process_time() - c0)
            for k, v in {"generation": m.get("time/generation", 0.0), "experience": t1 - t0, "update": t2 - t1}.items():
                parts.setdefault(k, []).append(v)
            seen["real_tokens"].append(int(exp.prompt_mask.sum() + exp.completion_mask.sum()))
            seen["completion_tokens"].append(int(exp.completion_mask.sum()))
            seen["unique_prompt_tokens"].append(int(mask.sum()))
    return {"library": "prefzoo", "algo": algo, "variant": variant, "wall": wall, "cpu": cpu, **seen,
            "parts": parts, "epochs": algo_obj.declaration.epochs, "peak_rss_gb": peak_rss_gb(), "threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------------------------- orchestration
def run_worker(library: str, algo: str, variant: str, workload_path: Path, workload: dict, beta: float, timeout: int,
               threads: int | None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if library == "trl":
        w = dict(workload, beta=beta, trl_gradient_checkpointing=not variant.endswith("nogc"),
                 trl_bf16=precision_of(variant) == "bf16")
        path = workload_path.with_name(f"trl_{algo}_{variant}_{beta}.json")
        path.write_text(json.dumps(w))
        cmd = [str(TRL_PYTHON), str(ROOT / "bench" / "trl_worker.py"), str(path), "grpo" if algo == "grpo" else algo]
    else:
        path = workload_path.with_name(f"prefzoo_{algo}_{variant}_{beta}.json")
        path.write_text(json.dumps(dict(workload, beta=beta)))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path), algo, variant]
    before = load_snapshot()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(ROOT))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"library": library, "algo": algo, "variant": variant, "error": f"exit {proc.returncode}: {tail}"}
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(variant=variant, beta=beta, process_s=time.perf_counter() - t0, load_before=before,
                  load_after=load_snapshot())
    return result


def summarise(r: dict, warmup: int, sizes: dict) -> dict:
    if "error" in r:
        return r
    wall, cpu = r["wall"][warmup:], r["cpu"][warmup:]
    tokens = {k: statistics.median(r[k][warmup:]) for k in ("real_tokens", "completion_tokens") if r.get(k)}
    tokens["unique_prompt_tokens"] = statistics.median(r["unique_prompt_tokens"][warmup:]) if r.get(
        "unique_prompt_tokens") else 0
    tokens["epochs"] = r.get("epochs", 1)
    step = statistics.median(wall)
    out = dict(r, step_s=step, cpu_s=statistics.median(cpu), spread_s=max(wall) - min(wall), tokens=tokens,
               tokens_per_s=tokens.get("real_tokens", 0) * tokens["epochs"] / step)
    if tokens.get("real_tokens") and tokens.get("completion_tokens"):
        out["flops"] = step_flops("ppo" if r["algo"] == "ppo" else ("grpo" if r["algo"].startswith("grpo") else r["algo"]),
                                  sizes, tokens, r.get("beta", 0.0))
    return out


def precision_of(variant: str) -> str:
    """``bf16`` for the bf16 variants (prefzoo ``bf16``/``autocast``, TRL ``bf16``/``bf16nogc``), else ``fp32``."""
    return "bf16" if variant in ("bf16", "autocast", "bf16nogc") else "fp32"


def fmt_table(rows: list[dict], peaks: dict[str, float]) -> str:
    """One line per run; the fraction of peak is of the matmul peak of the run's precision (``peaks``, GFLOP/s)."""
    lines = ["| algo | precision | library (variant) | step s (median) | CPU s | spread s | real tok/step | tok/s | "
             "peak RSS GB | FLOP bound (lora / 6N) G | % of its precision's peak (lora / 6N) | load (before, after) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["algo"] + (f" beta={r['beta']}" if r["algo"].startswith("grpo") else "")
        who = f"{r['library']} ({r['variant']})"
        prec = precision_of(r["variant"])
        if "error" in r:
            lines.append(f"| {label} | {prec} | {who} | error: {r['error'][:200]!r} |")
            continue
        f = r.get("flops", {})
        frac = lambda x: 100 * x / r["step_s"] / (peaks[prec] * 1e9)  # noqa: E731
        lines.append(
            f"| {label} | {prec} | {who} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['spread_s']:.2f} | "
            f"{r['tokens'].get('real_tokens', 0):.0f} | {r['tokens_per_s']:.0f} | {r['peak_rss_gb']:.2f} | "
            f"{f.get('lora', 0) / 1e9:.0f} / {f.get('6N', 0) / 1e9:.0f} | "
            f"{frac(f.get('lora', 0)):.0f}% / {frac(f.get('6N', 0)):.0f}% | "
            f"{r['load_before']['load1']:.1f}, {r['load_after']['load1']:.1f} |")
    return "\n".join(lines)


def _mark(x: float, target: float | None) -> str:
    return "" if target is None else " (target <= %.1f: %s)" % (target, "met" if x <= target else "NOT met")


def ratio_lines(rows: list[dict]) -> list[str]:
    """prefzoo / TRL ratios of step time and peak RSS for each pairing of variants of the same precision, prefzoo's
    bf16 / fp32 step time, and PPO / GRPO. Targets: issue 15 (step time <= 0.5x TRL's for DPO, SimPO and GRPO at the
    same precision; DPO's peak RSS <= 0.5x; prefzoo's bf16 DPO step <= 0.5x its fp32 one)."""
    out = []
    ok = [r for r in rows if "error" not in r]
    targets = {"dpo": (0.5, 0.5), "simpo": (0.5, None), "grpo": (0.5, None)}
    for algo in sorted({(r["algo"], r.get("beta", 0.0)) for r in ok}):
        name = f"{algo[0]}{' beta=' + str(algo[1]) if algo[0] == 'grpo' else ''}"
        pz = [r for r in ok if r["library"] == "prefzoo" and (r["algo"], r.get("beta", 0.0)) == algo]
        tr = [r for r in ok if r["library"] == "trl" and (r["algo"], r.get("beta", 0.0)) == algo]
        time_t, rss_t = targets.get(algo[0], (None, None))
        for p in pz:
            for t in tr:
                if precision_of(p["variant"]) != precision_of(t["variant"]):
                    continue
                tr_ratio, rss_ratio = p["step_s"] / t["step_s"], p["peak_rss_gb"] / t["peak_rss_gb"]
                out.append(f"- {name}, {precision_of(p['variant'])}: prefzoo ({p['variant']}) / TRL ({t['variant']}): "
                           f"step time {tr_ratio:.2f}x{_mark(tr_ratio, time_t)}, peak RSS {rss_ratio:.2f}x"
                           f"{_mark(rss_ratio, rss_t)}")
        base = [p for p in pz if p["variant"] == "default"]
        for p in pz:
            if precision_of(p["variant"]) == "bf16":
                for f in base:
                    x = p["step_s"] / f["step_s"]
                    out.append(f"- {name}: prefzoo ({p['variant']}) / prefzoo fp32 (default): step time {x:.2f}x"
                               f"{_mark(x, 0.5 if algo[0] == 'dpo' else None)}, peak RSS "
                               f"{p['peak_rss_gb'] / f['peak_rss_gb']:.2f}x")
    ppo = [r for r in ok if r["algo"] == "ppo"]
    grpo8 = [r for r in ok if r["algo"] == "grpo8"]
    for p in ppo:
        for g in grpo8:
            out.append(f"- ppo / prefzoo's grpo on the same rollout size (8 rows x 64 tokens): step time "
                       f"{p['step_s'] / g['step_s']:.2f}x ({p['epochs']} PPO epochs with a value adapter vs 1 GRPO pass), "
                       f"peak RSS {p['peak_rss_gb'] / g['peak_rss_gb']:.2f}x")
    return out


PLANS = {  # (algo, precision) -> [(library, variant, beta)], in the order of round 1 (flipped in even rounds)
    ("dpo", "fp32"): [("prefzoo", "default", 0.0), ("trl", "gc", 0.0), ("prefzoo", "gc", 0.0), ("trl", "nogc", 0.0)],
    ("dpo", "bf16"): [("prefzoo", "bf16", 0.0), ("trl", "bf16", 0.0), ("prefzoo", "autocast", 0.0)],
    ("simpo", "fp32"): [("prefzoo", "default", 0.0), ("trl", "gc", 0.0), ("prefzoo", "gc", 0.0), ("trl", "nogc", 0.0)],
    ("simpo", "bf16"): [("prefzoo", "bf16", 0.0), ("trl", "bf16", 0.0), ("prefzoo", "autocast", 0.0)],
    ("grpo", "fp32"): [("prefzoo", "default", 0.0), ("trl", "gc", 0.0), ("prefzoo", "nokl", 0.0),
                       ("prefzoo", "bf16rollout", 0.0), ("prefzoo", "default", 0.04), ("trl", "gc", 0.04),
                       ("prefzoo", "bf16rollout", 0.04)],
    ("grpo", "bf16"): [("prefzoo", "bf16", 0.0), ("trl", "bf16", 0.0), ("prefzoo", "autocast", 0.0)],
    ("ppo", "fp32"): [("prefzoo", "default", 0.0)],
    ("ppo", "bf16"): [("prefzoo", "bf16", 0.0)],
    ("grpo8", "fp32"): [("prefzoo", "default", 0.0)],
    ("grpo8", "bf16"): [("prefzoo", "bf16", 0.0)],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("WORKLOAD", "ALGO", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--algos", nargs="+", default=["dpo", "simpo", "grpo", "ppo"],
                    help="dpo simpo grpo ppo (ppo also runs prefzoo's grpo on 8 prompts x 1 sample, its yardstick)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every run, flipping the library order each round")
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                    help="fp32 (float32 in both) and/or bf16 (TRL bf16=True vs prefzoo model.dtype=bfloat16 and "
                         "model.compute_dtype=bfloat16)")
    ap.add_argument("--extra", nargs="*", default=[], metavar="LIBRARY:VARIANT:ALGO",
                    help="more runs, e.g. prefzoo:plain:dpo (every fast path off) prefzoo:gc:grpo trl:bf16nogc:dpo")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_trl.json"))
    args = ap.parse_args()
    if args.worker:
        path, algo, variant = args.worker
        w = json.loads(Path(path).read_text())
        print("RESULT " + json.dumps(prefzoo_worker(w, algo, variant)), flush=True)
        return 0
    if not TRL_PYTHON.exists():
        print(f"{TRL_PYTHON} is missing: create TRL's venv first (see this file's docstring, or `make bench-trl`).",
              file=sys.stderr)
        return 2
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="compare_trl_"))
    workload = write_workload(tmp / "workload.json", args)
    sizes = model_sizes(workload["model_dir"], workload["lora_r"])
    peaks = [{"fp32": matmul_peak("float32"), "bf16": matmul_peak("bfloat16"), "load1": os.getloadavg()[0]}]
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"threads {args.threads or torch.get_num_threads()}; matmul peak now: fp32 {peaks[0]['fp32']:.0f} GFLOP/s, "
          f"bf16 {peaks[0]['bf16']:.0f} GFLOP/s (load {peaks[0]['load1']:.1f})", flush=True)
    plan = []
    for algo in args.algos:
        for precision in args.precisions:
            plan += [(algo, lib, var, beta) for lib, var, beta in PLANS[algo, precision]]
            if algo == "ppo":
                plan += [("grpo8", lib, var, beta) for lib, var, beta in PLANS["grpo8", precision]]
    for spec in args.extra:
        lib, var, algo = spec.split(":")
        plan.append((algo, lib, var, 0.0))
    rows = []
    for rnd in range(args.rounds):
        order = plan if rnd % 2 == 0 else [x for pair in zip(plan[1::2], plan[0::2]) for x in pair] + (
            [plan[-1]] if len(plan) % 2 else [])
        last_algo = None
        for algo, lib, var, beta in order:
            if algo != last_algo and last_algo is not None:
                peaks.append({"fp32": matmul_peak("float32"), "bf16": matmul_peak("bfloat16"),
                              "load1": os.getloadavg()[0]})
            last_algo = algo
            w = dict(workload)
            w["prompts_per_step"] = 8 if algo == "ppo" else 2  # ppo: 8 prompts x 1 sample; grpo: 2 x 4; 8 rows
            w["prompts"] = workload["all_prompts"][: (args.steps + args.warmup) * w["prompts_per_step"]]
            r = run_worker(lib, algo, var, tmp / "workload.json", w, beta, args.timeout, args.threads)
            r = summarise(r, args.warmup, sizes)
            r["round"] = rnd
            rows.append(r)
            if "error" in r:
                print(f"  {algo} {lib} ({var}) beta={beta}: ERROR {r['error'][-500:]}", flush=True)
            else:
                print(f"  {algo} {lib} ({var}) beta={beta}: step {r['step_s']:.2f} s (cpu {r['cpu_s']:.2f}), "
                      f"rss {r['peak_rss_gb']:.2f} GB, load {r['load_before']['load1']:.1f}->{r['load_after']['load1']:.1f}",
                      flush=True)
    peaks.append({"fp32": matmul_peak("float32"), "bf16": matmul_peak("bfloat16"), "load1": os.getloadavg()[0]})
    peak = max(p["fp32"] for p in peaks)
    peak_bf16 = max(p["bf16"] for p in peaks)
    merged = merge_rounds(rows)
    print()
    measured = ", ".join("%.0f" % p["fp32"] for p in peaks)
    measured_bf16 = ", ".join("%.0f" % p["bf16"] for p in peaks)
    loads = ", ".join("%.1f" % p["load1"] for p in peaks)
    print(f"matmul peak measured: fp32 {measured} GFLOP/s, bf16 {measured_bf16} GFLOP/s (load {loads}); fractions "
          f"below use the highest of the run's precision, fp32 {peak:.0f} / bf16 {peak_bf16:.0f} GFLOP/s.")
    print()
    print(fmt_table(merged, {"fp32": peak, "bf16": peak_bf16}))
    print()
    print("\n".join(ratio_lines(merged)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"peaks": peaks, "peak_fp32": peak, "peak_bf16": peak_bf16,
                                          "rows": rows, "merged": merged,
                                          "setting": SETTING, "sizes": sizes}, indent=1, default=str))
    print(f"\n(raw results: {args.out})")
    return 0


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (algo, beta, library, variant): medians over rounds of the step time, CPU time and RSS."""
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["algo"], r.get("beta", 0.0), r["library"], r["variant"]), []).append(r)
    out = []
    for group in keyed.values():
        good = [r for r in group if "error" not in r]
        if not good:
            out.append(group[0])
            continue
        m = dict(good[0])
        for k in ("step_s", "cpu_s", "peak_rss_gb", "tokens_per_s"):
            m[k] = statistics.median(r[k] for r in good)
        m["spread_s"] = max(r["spread_s"] for r in good)
        m["load_before"] = {"load1": min(r["load_before"]["load1"] for r in good)}
        m["load_after"] = {"load1": max(r["load_after"]["load1"] for r in good)}
        m["rounds"] = len(good)
        out.append(m)
    return out


if __name__ == "__main__":
    sys.exit(main())
