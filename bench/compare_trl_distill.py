"""prefzoo's generalised JSD (``algo=distill``) and DAPO's overlong penalty against TRL 1.16's, on identical inputs.

    make setup-bench-trl                                   # bench/.venv-trl with trl 1.16.0 (once)
    .venv/bin/python bench/compare_trl_distill.py          # prints the table; exit status 1 if a value differs

What is compared. The divergence: TRL's ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (the
``DistillationTrainer``'s loss: student and teacher hidden states with their output layers, the token mean over the
completion mask) against :func:`prefzoo.objective.chunked_generalized_jsd` on the same states and weights, summed over
the mask and divided by the number of tokens as the plugin's ``dapo`` aggregation does; the value and its gradient in
the student's hidden states, at jsd_beta (TRL's ``beta``) 0, 0.5 and 1 and temperature 0.8, with the student's output
layer frozen (LoRA's case) and trained (full fine-tuning: prefzoo's checkpointed path). The penalty:
``trl.rewards.get_soft_overlong_punishment`` against :func:`prefzoo.objective.overlong_penalty` on lengths 0..40 with
L_max 32, L_cache 8.

Inputs (seed 0, float32): 3 completions x 6 positions (lengths 6, 4, 2), student width 16, teacher width 24 (only the
vocabulary must match), vocabulary 300; hidden states N(0, 1), output layers N(0, 0.3^2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BETAS, TEMPERATURE, L_MAX, CACHE = (0.0, 0.5, 1.0), 0.8, 32, 8


def inputs() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    b, k, v = 3, 6, 300
    return {"h_s": torch.randn(b, k, 16, generator=g).tolist(), "h_t": torch.randn(b, k, 24, generator=g).tolist(),
            "w_s": (torch.randn(v, 16, generator=g) * 0.3).tolist(), "w_t": (torch.randn(v, 24, generator=g) * 0.3).tolist(),
            "mask": (torch.arange(k)[None] < torch.tensor([6, 4, 2])[:, None]).long().tolist()}


def trl_side(infile: str, outfile: str) -> None:
    """Runs under TRL's interpreter."""
    import torch
    import trl
    from trl.rewards import get_soft_overlong_punishment
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    d = json.loads(Path(infile).read_text())
    out = {"trl": trl.__version__, "jsd": {}}
    for beta in BETAS:
        for trained in (False, True):
            h_s = torch.tensor(d["h_s"], requires_grad=True)
            w_s = torch.tensor(d["w_s"], requires_grad=trained)
            loss, _, _ = _chunked_divergence_loss(h_s, torch.tensor(d["h_t"]), w_s, torch.tensor(d["w_t"]),
                                                  torch.tensor(d["mask"]), beta, temperature=TEMPERATURE)
            (grad,) = torch.autograd.grad(loss, h_s)
            out["jsd"][f"{beta}-{trained}"] = {"loss": float(loss), "grad": grad.tolist()}
    punish = get_soft_overlong_punishment(L_MAX, CACHE)
    out["overlong"] = punish([[1] * n for n in range(41)])
    Path(outfile).write_text(json.dumps(out))


def main() -> int:
    import torch

    from prefzoo.objective import TokenLogits, chunked_generalized_jsd, overlong_penalty

    from common import trl_answer

    data = inputs()
    theirs = trl_answer(__file__, data)
    mask = torch.tensor(data["mask"]).bool()
    print(f"prefzoo vs TRL {theirs['trl']}: _chunked_divergence_loss ({int(mask.sum())} tokens, V=300, temperature "
          f"{TEMPERATURE}, float32) and get_soft_overlong_punishment (L_max {L_MAX}, L_cache {CACHE})\n")
    print("| quantity | value (prefzoo) | abs difference, value | max abs difference, gradient |")
    print("|---|---|---|---|")
    worst = 0.0
    for beta in BETAS:
        for trained in (False, True):
            h_s = torch.tensor(data["h_s"], requires_grad=True)
            w_s = torch.tensor(data["w_s"], requires_grad=trained)
            per = chunked_generalized_jsd(TokenLogits(h_s[mask], w_s), TokenLogits(torch.tensor(data["h_t"])[mask],
                                          torch.tensor(data["w_t"])), beta, TEMPERATURE, chunk_size=4)
            loss = per.sum() / mask.sum()
            (grad,) = torch.autograd.grad(loss, h_s)
            ref = theirs["jsd"][f"{beta}-{trained}"]
            dv = abs(loss.detach().item() - ref["loss"])
            dg = float((grad - torch.tensor(ref["grad"])).abs().max())
            worst = max(worst, dv, dg)
            layer = "trained" if trained else "frozen"
            print(f"| JSD jsd_beta={beta:g}, output layer {layer} | {loss.detach().item():.6f} | {dv:.2e} | {dg:.2e} |")
    ours = overlong_penalty(torch.arange(41), L_MAX, CACHE)
    d_over = float((ours - torch.tensor(theirs["overlong"])).abs().max())
    worst = max(worst, d_over)
    print(f"| overlong penalty, lengths 0..40 | {ours.min().item():.2f} .. {ours.max().item():.2f} | {d_over:.2e} | - |")
    print(f"\nlargest difference {worst:.2e} ({'agree to 1e-6' if worst <= 1e-6 else 'DIFFER'})")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-side":
        trl_side(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
