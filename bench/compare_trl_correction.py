"""prefzoo's sampler correction against TRL 1.16's, on identical log-probs: the four ``vllm_importance_sampling_mode``
values, several bands, one command.

    make setup-bench-trl                                   # bench/.venv-trl with trl 1.16.0 (once)
    .venv/bin/python bench/compare_trl_correction.py       # prints the table; exit status 1 if a value differs
    TRL_PYTHON=/path/to/venv/bin/python .venv/bin/python bench/compare_trl_correction.py

What is compared. TRL computes its importance-sampling ratio inline, inside ``GRPOTrainer._generate_and_score_completions``
(no function to call), so the TRL side reads that method's source from the installed trl, cuts out the block that
starts at ``if self.use_vllm and self.vllm_importance_sampling_correction:`` after the comment "Compute the importance
sampling ratio" and ends before "Compute the per-token log probabilities for the reference model", and runs exactly
that block on the inputs below, with ``self`` carrying the mode and the band. So TRL's own code runs, not a
transcription of it. prefzoo's side is :func:`prefzoo.objective.correction_weights`.

Inputs (seed 0): 6 completions x 9 positions; trainer - sampler log-ratios drawn from N(0, 0.6^2) per token; rows of
lengths 9, 7, 5, 9, 3, 6; one sampler log-prob NaN (an engine that could not score a token); in rows 3 and 5 three
positions are an environment's tokens (TRL's ``tool_mask`` 0, prefzoo's mask False). Compared on the policy's tokens
(where the weight multiplies a loss: TRL's ratio elsewhere is exp(0) clamped into the band, prefzoo's 1; neither
enters a loss).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


CASES = [("token_truncate", None, 3.0), ("token_truncate", 0.5, 2.0), ("token_mask", 0.5, 2.0),
         ("token_mask", None, 1.5), ("sequence_truncate", None, 3.0), ("sequence_truncate", 0.5, 2.0),
         ("sequence_mask", 0.5, 2.0), ("sequence_mask", None, 3.0)]


def inputs() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    b, t = 6, 9
    sampler = -torch.rand(b, t, generator=g) * 3 - 0.05
    trainer = sampler + torch.randn(b, t, generator=g) * 0.6
    lengths = torch.tensor([9, 7, 5, 9, 3, 6])
    completion = (torch.arange(t)[None] < lengths[:, None]).long()
    tool = torch.ones(b, t, dtype=torch.long)
    tool[3, 2:5] = 0
    tool[5, 1:4] = 0
    sampler[1, 4] = float("nan")
    return {"trainer": trainer.tolist(), "sampler": [[None if math.isnan(v) else v for v in row] for row in sampler.tolist()],
            "completion_mask": completion.tolist(), "tool_mask": tool.tolist()}


def trl_side(infile: str, outfile: str) -> None:
    """Runs under TRL's interpreter: TRL's own correction block on the inputs, for every case."""
    import inspect
    import textwrap
    from types import SimpleNamespace

    import torch
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer

    data = json.loads(Path(infile).read_text())
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("if self.use_vllm and self.vllm_importance_sampling_correction:",
                         source.index("# Compute the importance sampling ratio"))
    stop = source.index("# Compute the per-token log probabilities for the reference model", start)
    block = textwrap.dedent(source[source.rfind("\n", 0, start) + 1:stop])
    code = compile(block, "trl_importance_sampling_block", "exec")
    sampler = torch.tensor([[math.nan if v is None else v for v in row] for row in data["sampler"]])
    out = []
    for mode, low, high in CASES:
        me = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
                             vllm_importance_sampling_clip_min=low, vllm_importance_sampling_clip_max=high)
        scope = {"self": me, "torch": torch, "math": math, "old_per_token_logps": torch.tensor(data["trainer"]),
                 "sampling_per_token_logps": sampler.clone(), "completion_mask": torch.tensor(data["completion_mask"]),
                 "tool_mask": torch.tensor(data["tool_mask"])}
        exec(code, scope)
        ratio = scope["vllm_importance_sampling_ratio"]
        out.append(ratio.expand(sampler.shape).tolist())
    Path(outfile).write_text(json.dumps({"trl": trl.__version__, "ratios": out}))


def main() -> int:
    import torch

    from prefzoo.objective import correction_weights

    from common import trl_answer

    data = inputs()
    theirs = trl_answer(__file__, data)
    trainer = torch.tensor(data["trainer"])
    sampler = torch.tensor([[math.nan if v is None else v for v in row] for row in data["sampler"]])
    mask = torch.tensor(data["completion_mask"]).bool() & torch.tensor(data["tool_mask"]).bool()
    print(f"prefzoo correction_weights vs TRL {theirs['trl']} GRPOTrainer's importance-sampling block, "
          f"{int(mask.sum())} policy tokens in {mask.shape[0]} completions\n")
    print("| mode | clip_min | clip_max | max abs difference | weights changed by the band (prefzoo) |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for (mode, low, high), ratio in zip(CASES, theirs["ratios"]):
        ours, rejected = correction_weights(trainer, sampler, mask, mode, low, high)
        diff = float((ours - torch.tensor(ratio))[mask].abs().max())
        worst = max(worst, diff)
        print(f"| {mode} | {low} | {high} | {diff:.2e} | {int(rejected.sum())} of {int(mask.sum())} tokens |")
    print(f"\nlargest difference {worst:.2e} ({'agree to 1e-6' if worst <= 1e-6 else 'DIFFER'})")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-side":
        trl_side(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
