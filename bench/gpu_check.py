"""CUDA checks and step times on a GPU: 4-bit QLoRA on bitsandbytes' CUDA kernels, bf16 vs fp32, FSDP2, vLLM.

    python bench/gpu_check.py --model <SmolLM2 directory or HF id> [--steps 5]
    python bench/gpu_check.py --model tiny --cpu --skip-grpo        # a dry run of the script on the CPU

For each precision (fp32 weights; fp32 weights + bf16 autocast; bf16 weights; nf4 4-bit weights + LoRA, i.e.
QLoRA) it builds the policy exactly as the trainer does (``prefzoo.training.build.build_policy``) on
``cuda``, checks what runs (the 4-bit layers are bitsandbytes ``Linear4bit`` on the GPU, the loss is finite,
LoRA weights get a non-zero gradient, 4-bit log-probs stay close to the bf16 model's), then times DPO steps
(4 pairs x max_length 256, as ``bench/bench_preference.py``) and GRPO steps (2 prompts x 4 samples x 64 new
tokens, as ``bench/bench_grpo.py``): median step time after one warm-up step, real tokens/s, and peak GPU
memory (``torch.cuda.max_memory_allocated``).

FSDP2 (with 2 or more GPUs; ``--cpu``: 2 CPU processes): ``train.py algo=dpo`` for 3 steps on the test pairs
(``tests/fixtures/arithmetic_pairs.jsonl``, 4 pairs a step, micro-batches of 1) in one process, then through
``torchrun --nproc_per_node N ... trainer.fsdp=true`` on the same global batch; PASS when the two adapters differ
by at most 1e-3 of the adapter's largest weight (the reductions sum in another order, and Adam's first steps turn
a rounding gap in a near-zero gradient into up to lr: 1.5e-5 of the scale measured on 2 CPU processes; the exact
bounds are ``tests/distributed/test_fsdp.py``'s, on CPUs); the wall times of both runs.

vLLM (where vLLM imports in this Python; ``--skip-vllm`` skips it): ``train.py algo=grpo`` for 3 steps with
``rollout.engine=vllm`` (the in-process engine), then with ``rollout.engine=vllm_server`` on one ``prefzoo serve``
server started here (a free loopback port); PASS when the run ends and the engine's log-probs match the trainer's
recomputation (``engine/logp_diff_mean`` below 1e-3 nats per token at every step, float32); the mean step time and
the worst ``engine/logp_diff_max``. (On the CPU build the tiny model is widened to 128: vLLM's CPU attention needs
a head size of 32 or more.)

Used where the test machine has no GPU: the numbers printed here are what the README quotes for CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import compose, example_pairs  # noqa: E402

DEVICE = torch.device("cuda")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def reset_peak():
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb() -> float:
    if DEVICE.type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e9
    from common import peak_rss_gb

    return peak_rss_gb()


PRECISIONS = {  # name -> overrides
    "fp32": ["model.dtype=float32"],
    "fp32+bf16-autocast": ["model.dtype=float32", "model.compute_dtype=bfloat16"],
    "bf16": ["model.dtype=bfloat16"],
    "nf4 (QLoRA)": ["model.dtype=bfloat16", "model.quantization=4bit"],
}


def build(algo_name: str, model: str, extra: list[str]):
    from prefzoo.algos import get_algorithm
    from prefzoo.config import resolve_objective
    from prefzoo.models.loading import load_tokenizer
    from prefzoo.training.build import build_policy

    cfg = compose([f"algo={algo_name}", f"model.name={model}", "data.max_length=256", "model.lora.r=16",
                   "model.lora.alpha=32", f"trainer.device={DEVICE.type}"] + extra)
    algo = get_algorithm(algo_name)(cfg.algo, resolve_objective(cfg))
    tok = load_tokenizer(cfg.model.name)
    built = build_policy(cfg, algo.declaration, tok, DEVICE)
    return cfg, algo, tok, built


def timed(fn, steps: int) -> tuple[float, list]:
    out, times = [], []
    for _ in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        out.append(fn())
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out


def dpo_row(name: str, extra: list[str], args) -> dict:
    from prefzoo.data.preference import collate_preferences
    from prefzoo.training.step import accumulate_gradients

    reset_peak()
    cfg, algo, tok, built = build("dpo", args.model, extra)
    quantised = [m for m in built.model.modules() if type(m).__name__ == "Linear4bit"]
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    examples = example_pairs(tok, 4, 256)
    batch = collate_preferences(examples, list(range(4)), tok.pad_token_id).to(DEVICE)

    def step():
        opt.zero_grad(set_to_none=True)
        stats = accumulate_gradients(algo, built.policy, batch, 4)
        grad = sum(float(p.grad.abs().sum()) for p in params if p.grad is not None)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return stats, grad

    with torch.no_grad():  # log-probs of the chosen answers before any step: compared across precisions
        logps, _ = built.policy.logps(batch.chosen)
    step_s, outs = timed(step, args.steps)
    stats, grad = outs[0]
    return {"name": name, "step_s": step_s, "tokens_per_s": batch.num_tokens() / step_s,
            "peak_gb": peak_gb(), "linear4bit": len(quantised),
            "loss": float(stats["loss"][0]), "grad_abs_sum": grad, "chosen_logps": logps.sum(-1).cpu(),
            "weight_device": str(next(built.model.parameters()).device)}


def grpo_row(name: str, extra: list[str], beta: float, args) -> dict:
    from prefzoo.types import SamplingParams
    from prefzoo.training.scoring import TextScorer
    from prefzoo.training.setup import build_reward, task_prompts
    from prefzoo.training.step import accumulate_gradients

    reset_peak()
    cfg, algo, tok, built = build("grpo", args.model, extra + [f"objective.beta={beta}", "algo.num_samples=4"])
    policy = built.policy
    policy.eos_token_ids = [-1]  # never stop early: every step generates exactly 64 new tokens
    train, _ = task_prompts(cfg, tok)
    scorer = TextScorer(tok, build_reward(cfg), policy.pad_id)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=64)
    algo = type(algo)(cfg.algo, algo.objective, sampling)  # the plugin gets the rollout's sampling settings once
    state = {"i": 0}

    def step():
        i = state["i"] = state["i"] + 1
        prompts = train.batch([2 * i, 2 * i + 1], policy.pad_id).to(DEVICE)
        exp, m = algo.make_experience(policy, prompts, scorer)
        opt.zero_grad(set_to_none=True)
        accumulate_gradients(algo, policy, exp, 8)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return m["time/generation"]

    step_s, gens = timed(step, args.steps)
    return {"name": name, "beta": beta, "step_s": step_s, "gen_s": statistics.median(gens[1:]),
            "peak_gb": peak_gb()}


def fsdp_row(args) -> dict:
    """One process against ``torchrun`` with N processes under FSDP2 on the same DPO steps (module docstring)."""
    import os
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    n = 2 if DEVICE.type == "cpu" else torch.cuda.device_count()
    common_args = ["algo=dpo", f"model={args.model}", "data=file",
                   f"data.path={ROOT / 'tests' / 'fixtures' / 'arithmetic_pairs.jsonl'}", "data.max_length=96",
                   "data.max_prompt_length=64", "trainer.batch_size=4", "trainer.micro_batch_size=1",
                   "trainer.max_steps=3", "trainer.lr=5e-3", "trainer.save_every=0", "eval.before=false",
                   "eval.after=false", "trainer.progress=false", "trainer.tensorboard=false",
                   f"trainer.device={DEVICE.type}", "model.fast.merged_rollout=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    out = {"processes": n}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"one": [sys.executable, str(ROOT / "train.py"), *common_args],
                "fsdp": [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(n),
                         str(ROOT / "train.py"), *common_args, "trainer.fsdp=true"]}
        for name, cmd in runs.items():
            t0 = time.perf_counter()
            proc = subprocess.run([*cmd, f"hydra.run.dir={Path(tmp) / name}"], env=env, capture_output=True,
                                  text=True, cwd=ROOT)
            out[f"{name}_s"] = time.perf_counter() - t0
            if proc.returncode:
                out["error"] = f"{name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
                return out
        a = load_file(str(Path(tmp) / "one" / "adapter" / "adapter_model.safetensors"))
        b = load_file(str(Path(tmp) / "fsdp" / "adapter" / "adapter_model.safetensors"))
    out["max_diff"] = max(float((a[k] - b[k]).abs().max()) for k in a)
    out["scale"] = max(float(a[k].abs().max()) for k in a)
    out["passed"] = a.keys() == b.keys() and out["max_diff"] <= 1e-3 * out["scale"]
    return out


def vllm_row(args, engine: str) -> dict:
    """``train.py algo=grpo`` 3 steps with ``rollout.engine=engine`` (``vllm``, or ``vllm_server`` on a ``prefzoo serve``
    started here): whether it ran, the mean step time and the engine/trainer log-prob gaps (module docstring)."""
    import json
    import os
    import socket
    import subprocess
    import tempfile
    import urllib.request

    tiny = ["model.tiny_hidden_size=128"] if args.model == "tiny" else []
    common_args = ["algo=grpo", f"model={args.model}", "trainer.max_steps=3", "trainer.batch_size=2", "algo.num_samples=4",
                   "rollout.max_new_tokens=32", "eval.before=false", "eval.after=false", "trainer.save_every=0",
                   "trainer.progress=false", "trainer.tensorboard=false", f"trainer.device={DEVICE.type}",
                   "model.lora.r=16", "trainer.num_threads=1" if DEVICE.type == "cpu" else "trainer.num_threads=0",
                   *tiny, f"rollout.engine={engine}"]
    server, out = None, {"engine": engine}
    env = {**os.environ, "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if engine == "vllm_server":
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                serve = [sys.executable, "-m", "prefzoo", "serve", "--model", args.model, "--port", str(port),
                         "--max-lora-rank", "16"] + (["--tiny-hidden-size", "128", "--threads", "1"] if DEVICE.type == "cpu" else [])
                server = subprocess.Popen(serve, stdout=open(Path(tmp) / "server.log", "w"), stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=ROOT)
                url, t0 = f"http://127.0.0.1:{port}", time.perf_counter()
                while True:
                    try:
                        urllib.request.urlopen(f"{url}/v1/models", timeout=2)
                        break
                    except OSError:
                        if server.poll() is not None or time.perf_counter() - t0 > 900:
                            out["error"] = "prefzoo serve did not start: " + (Path(tmp) / "server.log").read_text()[-300:]
                            return out
                        time.sleep(2)
                out["server_start_s"] = time.perf_counter() - t0
                common_args.append(f"rollout.servers=[{url}]")
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *common_args, f"hydra.run.dir={tmp}/run"],
                                  env=env, capture_output=True, text=True, cwd=ROOT)
            out["wall_s"] = time.perf_counter() - t0
            if proc.returncode:
                out["error"] = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
                return out
            steps = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            steps = [m for m in steps if "engine/logp_diff_mean" in m]
        finally:
            if server is not None and server.poll() is None:
                os.killpg(server.pid, 15)
                server.wait(timeout=120)
    out["step_s"] = statistics.mean(m["time/step"] for m in steps if "time/step" in m) if steps else float("nan")
    out["diff_mean"] = max((m["engine/logp_diff_mean"] for m in steps), default=float("nan"))
    out["diff_max"] = max((m["engine/logp_diff_max"] for m in steps), default=float("nan"))
    out["passed"] = len(steps) == 3 and out["diff_mean"] < 1e-3
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-grpo", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="dry run of this script on the CPU (no 4-bit)")
    ap.add_argument("--skip-fsdp", action="store_true")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--only-vllm", action="store_true", help="the vLLM lines alone")
    args = ap.parse_args()
    global DEVICE
    if args.cpu:
        DEVICE = torch.device("cpu")
        PRECISIONS.pop("nf4 (QLoRA)")
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    print(f"# {torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'CPU'}, torch {torch.__version__}, model {args.model}")
    failed = 0
    if not args.skip_vllm:
        failed += vllm_lines(args)
    if args.only_vllm:
        return int(failed > 0)
    print("| DPO, 4 pairs x 256 | step (ms) | tokens/s | peak GPU (GB) | Linear4bit layers | first loss |")
    print("|---|---|---|---|---|---|")
    rows = []
    for name, extra in PRECISIONS.items():
        r = dpo_row(name, extra, args)
        rows.append(r)
        print(f"| {name} | {1000 * r['step_s']:.0f} | {r['tokens_per_s']:.0f} | {r['peak_gb']:.2f} | "
              f"{r['linear4bit']} | {r['loss']:.4f} |", flush=True)
        assert r["weight_device"].startswith(DEVICE.type), r
        assert r["grad_abs_sum"] > 0 and r["loss"] == r["loss"], r
    if not args.cpu:
        assert rows[-1]["linear4bit"] > 0, "QLoRA built no bitsandbytes Linear4bit layer"
    bf16 = next(r for r in rows if r["name"] == "bf16")["chosen_logps"]
    for r in rows:  # per-answer log-probs (about 120 tokens each) against the bf16 model
        print(f"{r['name']}: chosen log-probs {[round(float(x), 1) for x in r['chosen_logps']]}, "
              f"max |diff| to bf16 {float((r['chosen_logps'] - bf16).abs().max()):.2f} nats")
    if not args.skip_grpo:
        print("| GRPO, 2 prompts x 4 x 64 new | beta | step (ms) | of which generation (ms) | peak GPU (GB) |")
        print("|---|---|---|---|---|")
        for name in ("fp32", "bf16"):
            for beta in (0.0, 0.04):
                r = grpo_row(name, PRECISIONS[name], beta, args)
                print(f"| {name} | {beta} | {1000 * r['step_s']:.0f} | {1000 * r['gen_s']:.0f} | {r['peak_gb']:.2f} |",
                      flush=True)
    if args.skip_fsdp:
        return int(failed > 0)
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 2:
        print("FSDP2: skipped (one GPU: nothing to shard over)")
        return int(failed > 0)
    r = fsdp_row(args)
    if "error" in r:
        print(f"FSDP2: FAIL ({r['error']})")
        return 1
    print(f"FSDP2, DPO 3 steps on {r['processes']} processes against 1: {'PASS' if r['passed'] else 'FAIL'} (max "
          f"|adapter diff| {r['max_diff']:.2e} of weights up to {r['scale']:.2e}; wall {r['one_s']:.0f} s for 1 "
          f"process, {r['fsdp_s']:.0f} s sharded)")
    return 0 if r["passed"] and not failed else 1


def vllm_lines(args) -> int:
    """The in-process vLLM engine's line and one vLLM server's; the number that failed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print("vLLM: skipped (not installed in this Python: pip install vllm, or make setup-vllm on a CPU)")
        return 0
    failed = 0
    for engine in ("vllm", "vllm_server"):
        r = vllm_row(args, engine)
        if "error" in r:
            print(f"{engine}: FAIL ({r['error']})", flush=True)
            failed += 1
            continue
        start = f", server started in {r['server_start_s']:.0f} s" if "server_start_s" in r else ""
        print(f"{engine}, GRPO 3 steps: {'PASS' if r['passed'] else 'FAIL'} (engine/trainer log-prob gap: mean "
              f"{r['diff_mean']:.1e}, max {r['diff_max']:.1e} nats/token; {r['step_s']:.2f} s a step; run "
              f"{r['wall_s']:.0f} s{start})", flush=True)
        failed += not r["passed"]
    return failed


if __name__ == "__main__":
    sys.exit(main())
