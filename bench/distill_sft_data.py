"""The training set of distillation's offline baseline: SFT on the teacher's own samples (sequence-level KD).

    .venv/bin/python bench/distill_sft_data.py --teacher runs/teacher --out runs/teacher_samples --temperature 1.0
    python train.py algo=sft data=file data.path=runs/teacher_samples data.eval_split=test trainer.batch_size=32 \
        trainer.max_steps=30 eval.before=false eval.every=10 hydra.run.dir=runs/sft-teacher

On-policy distillation (``algo=distill``) trains the student on the student's own completions, scored token by token by
the teacher. Its standard offline counterpart (Kim & Rush 2016, "sequence-level knowledge distillation"; the GKD
paper's SeqKD baseline, Agarwal et al. 2024) samples completions from the teacher once and
fine-tunes the student on them by maximum likelihood. This script does the sampling: one completion per training
prompt of the teacher run's own task (``data.*`` of its ``config.yaml``: the arithmetic task's first ``--num-prompts``
training problems), at the teacher's rollout temperature and length (``rollout.temperature``,
``rollout.max_new_tokens``) unless given (distillation samples at ``algo=distill``'s temperature, 1.0 by default), and
writes a dataset folder for ``data=file``: ``train.jsonl``, preference rows ``prompt`` (the chat messages),
``chosen`` (the teacher's completion, an assistant message), ``answer``; ``test.jsonl``, the task's held-out problems
in the task's order (the rows every other run of the task is evaluated on), ``chosen`` the right answer.
``algo=sft`` trains on ``chosen`` only; ``rejected``, which a pair must have and which must differ, is the fixed text
"I do not know." and enters nothing but the held-out preference accuracy. The budget matches ``algo=distill
trainer.batch_size=32 trainer.max_steps=30``: 960 completions, one per prompt, one pass of 30 optimizer steps of 32.

Prints the sampling time (seconds, the offline method's one-off cost) and the share of samples the task's verifier
accepts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REJECTED = "I do not know."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", required=True, help="a trained prefzoo run folder (its adapter/ and config.yaml)")
    parser.add_argument("--out", required=True, help="the dataset folder to write (train.jsonl, test.jsonl)")
    parser.add_argument("--num-prompts", type=int, default=960)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from prefzoo.api import one_line
    from prefzoo.data.preference import prompt_text
    from prefzoo.data.tasks import get_task
    from prefzoo.errors import PrefzooError
    from prefzoo.rewards.arithmetic import correctness
    from prefzoo.training.trained import load_trained_model

    torch.set_num_threads(args.threads)
    try:
        model, tokenizer, _ = load_trained_model(args.teacher)
    except PrefzooError as err:
        print(one_line(err), file=sys.stderr)
        return 2
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(args.teacher) / "config.yaml")  # load_trained_model read it: it is there
    if cfg.data.name != "arithmetic":
        print(f"--teacher {args.teacher}: its task is data={cfg.data.name}; this script samples the arithmetic task's "
              "prompts.", file=sys.stderr)
        return 2
    task = get_task("arithmetic", digits=cfg.data.digits, ops=list(cfg.data.ops), num_train=cfg.data.num_train,
                    num_eval=cfg.data.num_eval, seed=cfg.data.seed, word_problems=cfg.data.word_problems)
    problems = task.train()[: args.num_prompts]
    temperature = cfg.rollout.temperature if args.temperature is None else args.temperature
    max_new = cfg.rollout.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    torch.manual_seed(args.seed)
    rows, start = [], time.perf_counter()
    for i in range(0, len(problems), args.batch_size):
        chunk = problems[i:i + args.batch_size]
        texts = [prompt_text(tokenizer, p["prompt"]) for p in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new, pad_token_id=tokenizer.pad_token_id)
        completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        for p, c in zip(chunk, completions):
            rows.append({"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": c.strip() or "?"}],
                         "rejected": [{"role": "assistant", "content": REJECTED}], "answer": p["answer"]})
        print(f"\r{len(rows)}/{len(problems)} sampled", end="", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    right = correctness([""] * len(rows), [r["chosen"][0]["content"] for r in rows], [r["answer"] for r in rows])
    held = [{"prompt": p["prompt"], "chosen": [{"role": "assistant", "content": str(p["answer"])}],
             "rejected": [{"role": "assistant", "content": REJECTED}], "answer": p["answer"]} for p in task.eval()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in (("train", rows), ("test", held)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in table:
                f.write(json.dumps(r) + "\n")
    print(f"\n{len(rows)} teacher samples (T={temperature}, {max_new} tokens) -> {args.out} in {seconds:.0f} s; "
          f"verifier accepts {sum(right) / len(rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
