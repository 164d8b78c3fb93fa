"""A cookbook-style RL loop through a Tinker API server, at prefzoo's default GRPO budget (issue 50, A.3).

Written against the ``tinker`` SDK alone, the way the cookbook's ``rl_loop.py`` is: each step saves the weights and
gets a sampling client, samples a group per prompt, scores the completions, builds one ``Datum`` per completion with
its advantage on the completion's positions, and sends ``forward_backward(..., "ppo")`` + ``optim_step``. The budget
and the settings are ``python train.py algo=grpo``'s, so the two can be compared:

* 40 steps x 8 prompts x 4 samples, up to 64 new tokens, the arithmetic task's training prompts
  (``prefzoo.training.setup.task_prompts``, the chat template applied), the same correctness reward;
* temperature 1.0 by default (the cookbook's; prefzoo's GRPO samples at 0.7): the SDK returns each sampled token's
  log-prob under the distribution it was drawn from, after the temperature, while ``forward_backward`` scores the
  model's own (temperature 1), so at 0.7 the ppo ratio exp(lp - s) starts away from 1 and the clip acts on it from the
  first step (measured below: 0.625 held out at 0.7 against 0.725 at 1.0);
* advantages (r - mean) / (std + 1e-4) within each group (prefzoo's ``scale_rewards=group``; torch's std, n - 1);
* the ppo loss with ratio bounds 0.8 / 1.2 (prefzoo's clip_eps 0.2); the SDK sums over positions, so the advantages
  are divided by the step's completion tokens: the token mean prefzoo's GRPO takes (the gradient norm, which the
  clip at 1.0 sees, is then the same scale);
* LoRA rank 16 on the attention and MLP layers (``train_unembed=False``: prefzoo's ``all-linear``);
* AdamW lr 2e-4 with prefzoo's warm-up and linear decay (``prefzoo.training.loop.lr_lambda``), betas (0.9, 0.999),
  eps 1e-8, no weight decay, the gradient clipped at norm 1.0.

What differs from the in-process run: the prompts are drawn by this script's own seeded shuffle (not the loop's), the
sampler's random stream is the server's, and there is no KL metric pass. At the end the adapter is saved with
``save_state`` (a peft folder on the server's disk) and its path printed, for the held-out evaluation:

    prefzoo serve --api tinker --model smollm2 --port 8123 --checkpoint-dir runs/tinker &
    python bench/tinker_rl_loop.py --url http://127.0.0.1:8123 --out runs/tinker_rl.json
    python train.py algo=grpo trainer.max_steps=0 model.adapter_path=<the printed folder>   # n = 200, greedy

Measured 2026-12-06 (SmolLM2-135M-Instruct, fp32, server and client one torch thread each on a 2-core machine shared
with other work; docs/tinker.md, "On the real model"): held-out accuracy 0.255 -> 0.725 +- 0.032 (pass@4 0.80) at
temperature 1.0, 0.625 +- 0.034 at 0.7; ``python train.py algo=grpo`` 0.740 +- 0.031 (0.7).

Prints per step: the mean reward, the step's wall time and its parts (sampling, forward_backward + optim_step).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import tinker
import torch
from tinker import types

from prefzoo.api import compose
from prefzoo.rewards.arithmetic import correctness
from prefzoo.training.loop import lr_lambda
from prefzoo.training.setup import task_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--base-model", default="smollm2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default=None, help="the server's --checkpoint-dir (to print the folder)")
    ap.add_argument("--out", default=None, help="a JSON file for the per-step record")
    args = ap.parse_args()

    service = tinker.ServiceClient(base_url=args.url, api_key="tml-local")
    # prefzoo's LoRA: rank 16 on every linear layer but the output layer (peft's all-linear); the SDK's default
    # would add the (tied) output layer
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=args.seed,
                                                   train_unembed=False).result()
    tokenizer = training.get_tokenizer()
    cfg, _ = compose(["algo=grpo"])
    train, _ = task_prompts(cfg, tokenizer)
    schedule = lr_lambda("linear", 2, args.steps)
    order = list(range(len(train)))
    rng = random.Random(args.seed)
    rng.shuffle(order)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=stop)
    record = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        sampler = training.save_weights_and_get_sampling_client(name=f"step-{step:03d}").result()
        picks = [order[((step - 1) * args.prompts + i) % len(order)] for i in range(args.prompts)]
        futures = [sampler.sample(types.ModelInput.from_ints(train.prompt_ids[i]), num_samples=args.group,
                                  sampling_params=params.model_copy(update={"seed": args.seed * 100003 + step * 97 + j}))
                   for j, i in enumerate(picks)]
        results = [f.result() for f in futures]
        t_sample = time.perf_counter() - t0
        rows, rewards_all = [], []
        for i, res in zip(picks, results):
            seqs = res.sequences
            texts = [tokenizer.decode(s.tokens, skip_special_tokens=True) for s in seqs]
            rewards = correctness([train.texts[i]] * len(seqs), texts, answer=[train.columns["answer"][i]] * len(seqs))
            rewards_all += rewards
            mean = statistics.fmean(rewards)
            std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
            for s, r in zip(seqs, rewards):
                rows.append((train.prompt_ids[i], list(s.tokens), list(s.logprobs), (r - mean) / (std + 1e-4)))
        n_tokens = sum(len(toks) for _, toks, _, _ in rows)
        datums = []
        for prompt, toks, lps, adv in rows:
            if adv == 0.0 or not toks:
                continue  # a group with one reward: no gradient (prefzoo's GRPO skips the same rows' signal)
            full = prompt + toks
            n_prompt = len(prompt) - 1
            datums.append(types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": torch.tensor(full[1:], dtype=torch.long),
                    "logprobs": torch.tensor([0.0] * n_prompt + lps, dtype=torch.float32),
                    "advantages": torch.tensor([0.0] * n_prompt + [adv / n_tokens] * len(toks), dtype=torch.float32),
                }))
        t1 = time.perf_counter()
        lr = args.lr * schedule(step - 1)
        if datums:
            fb = training.forward_backward(datums, "ppo", loss_fn_config={"clip_low_threshold": 0.8,
                                                                          "clip_high_threshold": 1.2})
            opt = training.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                                                       weight_decay=0.0, grad_clip_norm=1.0))
            fb.result()
            opt.result()
        t_update = time.perf_counter() - t1
        row = {"step": step, "reward": statistics.fmean(rewards_all), "lr": lr, "datums": len(datums),
               "completion_tokens": n_tokens, "time/step": time.perf_counter() - t0, "time/sampling": t_sample,
               "time/update": t_update}
        record.append(row)
        print(json.dumps(row), flush=True)
    saved = training.save_state(name="final").result()
    folder = Path(args.checkpoint_dir) / saved.path.removeprefix("tinker://") if args.checkpoint_dir else saved.path
    print(f"saved state: {saved.path} ({folder})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": record, "state": saved.path, "folder": str(folder)}, indent=1))


if __name__ == "__main__":
    main()
