"""One TRL measurement, run by ``bench/compare_trl.py`` in TRL's own virtual environment (``bench/.venv-trl``).

This file imports TRL, transformers, peft, datasets and torch only (prefzoo is not installed in that venv). It
reads the shared workload (texts, settings) from a JSON file written by ``compare_trl.py``, trains for
``warmup + steps`` steps, and prints ONE line ``RESULT {json}`` with the per-step wall and CPU times, the token
counts the trainer really saw, and the process's peak RSS. Each measurement is its own process, so the peak RSS
is TRL's alone. ``trl_bf16``: the Trainer's ``bf16=True`` (autocast over the float32 weights). SimPO: TRL's
``simpo_gamma`` is the target margin gamma itself; the workload carries prefzoo's beta and gamma (compare_trl.py).

    bench/.venv-trl/bin/python bench/trl_worker.py WORKLOAD.json dpo|simpo|grpo
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


def main() -> int:
    workload_path, algo = sys.argv[1], sys.argv[2]
    w = json.load(open(workload_path))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.manual_seed(0)
    steps, warmup = w["steps"], w["warmup"]
    total = steps + warmup
    tok = AutoTokenizer.from_pretrained(w["model_dir"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(w["model_dir"], dtype=torch.float32)
    lora = LoraConfig(r=w["lora_r"], lora_alpha=w["lora_alpha"], lora_dropout=0.0, target_modules="all-linear",
                      bias="none", task_type="CAUSAL_LM")
    seen = {"real_tokens": [], "completion_tokens": [], "padded_tokens": []}
    times = {"wall": [], "cpu": []}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            times["wall"].append(time.perf_counter() - self.t0)
            times["cpu"].append(time.process_time() - self.c0)

    common = dict(output_dir="/tmp/prefzoo_trl_bench", max_steps=total, learning_rate=1e-5,
                  bf16=w.get("trl_bf16", False), fp16=False,
                  use_cpu=True, report_to=[], save_strategy="no", logging_steps=10 ** 6, max_grad_norm=1.0,
                  gradient_accumulation_steps=1, dataloader_num_workers=0, seed=0,
                  gradient_checkpointing=w["trl_gradient_checkpointing"], disable_tqdm=True)
    if algo in ("dpo", "simpo"):
        # exactly the batch's pairs: every step (one epoch) trains on the same 4 pairs, as prefzoo's worker does
        data = Dataset.from_list([{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                                  for r in w["pairs"][: w["batch"]]])
        if algo == "dpo":
            from trl import DPOConfig, DPOTrainer

            args = DPOConfig(per_device_train_batch_size=w["batch"], max_length=w["max_length"], beta=0.1, **common)
            trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=lora,
                                 callbacks=[Timer()])
        else:
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            args = CPOConfig(per_device_train_batch_size=w["batch"], max_length=w["max_length"], loss_type="simpo",
                             cpo_alpha=0.0, beta=w["simpo_beta"], simpo_gamma=w["simpo_gamma"], **common)
            trainer = CPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=lora,
                                 callbacks=[Timer()])
        original = trainer.compute_loss

        def counting_loss(model, inputs, *a, **k):  # what the trainer really feeds the model
            mask = inputs.get("attention_mask")
            if mask is None:  # CPO: concatenated_* keys are built inside; count chosen + rejected rows
                m = [inputs[k] for k in ("chosen_attention_mask", "rejected_attention_mask") if k in inputs]
                seen["real_tokens"].append(int(sum(x.sum() for x in m)))
                seen["padded_tokens"].append(int(sum(x.numel() for x in m)))
            else:
                seen["real_tokens"].append(int(mask.sum()))
                seen["padded_tokens"].append(int(mask.numel()))
            return original(model, inputs, *a, **k)

        trainer.compute_loss = counting_loss
    elif algo == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        prompts = w["prompts"]
        data = Dataset.from_list([{"prompt": p["text"], "answer": p["answer"]}
                                  for p in prompts[: w["prompts_per_step"] * total]])

        def correct(completions, answer, **kw):  # last number in the reply == the answer
            out = []
            for c, a in zip(completions, answer):
                nums = re.findall(r"-?\d+", c)
                out.append(1.0 if nums and int(nums[-1]) == int(a) else 0.0)
            return out

        g = w["generations"]
        args = GRPOConfig(per_device_train_batch_size=w["prompts_per_step"] * g, num_generations=g,
                          max_completion_length=w["max_new_tokens"], temperature=1.0, top_p=1.0, beta=w["beta"],
                          generation_kwargs={"min_new_tokens": w["max_new_tokens"]}, shuffle_dataset=False, **common)
        trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=data, processing_class=tok,
                              peft_config=lora, callbacks=[Timer()])
        original = trainer._generate_and_score_completions

        def counting(inputs):
            out = original(inputs)
            seen["real_tokens"].append(int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            seen["completion_tokens"].append(int(out["completion_mask"].sum()))
            seen["padded_tokens"].append(int(out["prompt_mask"].numel() + out["completion_mask"].numel()))
            return out

        trainer._generate_and_score_completions = counting
    else:
        raise SystemExit(f"unknown algo {algo}")
    trainer.train()
    print("RESULT " + json.dumps({"library": "trl", "algo": algo, "wall": times["wall"], "cpu": times["cpu"],
                                  **seen, "peak_rss_gb": peak_rss_gb(), "threads": torch.get_num_threads(),
                                  "settings": {"gradient_checkpointing": args.gradient_checkpointing,
                                               "precompute_ref": getattr(args, "precompute_ref_log_probs", None)}}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
