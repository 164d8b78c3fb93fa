"""prefzoo's SAPO loss and bias-corrected KL against TRL 1.16's, on identical log-probs: values and gradients.

    make setup-bench-trl                                   # bench/.venv-trl with trl 1.16.0 (once)
    .venv/bin/python bench/compare_trl_losses.py           # prints the table; exit status 1 if a value differs

What is compared. TRL computes both inline in ``GRPOTrainer._compute_loss``, so the TRL side reads that method's source
from the installed trl, cuts the block from ``log_ratio = per_token_logps - old_per_token_logps`` to the
``elif self.loss_type == "vespo":`` branch (the ratio, the KL with ``use_bias_correction_kl``, and the cispo / grpo /
sapo per-token losses) and runs it with ``self`` carrying the settings: TRL's own code runs, not a transcription. Its
outputs: ``per_token_loss`` and ``per_token_kl``, and their gradients (summed over the mask) with respect to the
policy's log-probs. prefzoo's side: :func:`prefzoo.objective.sapo_loss` and :func:`prefzoo.objective.kl_loss` with
``old_logps`` (``objective.kl_bias_correction``), and ``clipped_surrogate_loss`` for TRL's ``grpo`` loss type.

Inputs (seed 0): 5 completions x 8 positions, float64; log pi_old uniform in [-3, -0.05], log pi = log pi_old +
N(0, 0.3^2) (ratios between ~0.4 and ~2.5, both sides of SAPO's gate and of the clip), log pi_ref = log pi_old +
N(0, 0.5^2); advantages N(0, 1) per completion (both signs: SAPO's two temperatures); rows of lengths 8, 6, 8, 3, 5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TAU_POS, TAU_NEG, EPS = 1.0, 1.05, 0.2


def inputs() -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    b, t = 5, 8
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 2.95 - 0.05
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.arange(t)[None] < torch.tensor([8, 6, 8, 3, 5])[:, None]).long()
    return {"logps": new.tolist(), "old": old.tolist(), "ref": ref.tolist(), "adv": adv.tolist(), "mask": mask.tolist()}


def trl_side(infile: str, outfile: str) -> None:
    """Runs under TRL's interpreter: TRL's own block on the inputs, for loss types sapo and grpo."""
    import inspect
    import textwrap
    from types import SimpleNamespace

    import torch
    import trl
    from trl.trainer.grpo_trainer import GRPOTrainer

    data = json.loads(Path(infile).read_text())
    source = inspect.getsource(GRPOTrainer._compute_loss)
    start = source.index("log_ratio = per_token_logps - old_per_token_logps")
    stop = source.index('elif self.loss_type == "vespo":', start)
    block = textwrap.dedent(source[source.rfind("\n", 0, start) + 1:source.rfind("\n", 0, stop) + 1])
    code = compile(block, "trl_compute_loss_block", "exec")
    out = {"trl": trl.__version__}
    for loss_type in ("sapo", "grpo"):
        args = SimpleNamespace(use_bias_correction_kl=True, delta=None, sapo_temperature_pos=TAU_POS,
                               sapo_temperature_neg=TAU_NEG)
        me = SimpleNamespace(importance_sampling_level="token", beta=0.04, args=args, loss_type=loss_type,
                             epsilon_low=EPS, epsilon_high=EPS)
        logps = torch.tensor(data["logps"], dtype=torch.float64, requires_grad=True)
        mask = torch.tensor(data["mask"], dtype=torch.float64)
        scope = {"self": me, "torch": torch, "per_token_logps": logps, "old_per_token_logps": torch.tensor(data["old"],
                 dtype=torch.float64), "advantages": torch.tensor(data["adv"], dtype=torch.float64)[:, None],
                 "mask": mask, "inputs": {"ref_per_token_logps": torch.tensor(data["ref"], dtype=torch.float64)}}
        exec(code, scope)
        loss, kl = scope["per_token_loss"], scope["per_token_kl"]
        (g_loss,) = torch.autograd.grad((loss * mask).sum(), logps, retain_graph=True)
        (g_kl,) = torch.autograd.grad((kl * mask).sum(), logps)
        out[loss_type] = {"loss": loss.tolist(), "kl": kl.tolist(), "g_loss": g_loss.tolist(), "g_kl": g_kl.tolist()}
    Path(outfile).write_text(json.dumps(out))


def main() -> int:
    import torch

    from prefzoo.objective import clipped_surrogate_loss, kl_loss, sapo_loss

    from common import trl_answer

    data = inputs()
    theirs = trl_answer(__file__, data)
    mask = torch.tensor(data["mask"]).bool()
    old, ref = torch.tensor(data["old"], dtype=torch.float64), torch.tensor(data["ref"], dtype=torch.float64)
    adv = torch.tensor(data["adv"], dtype=torch.float64)

    def ours(fn):
        logps = torch.tensor(data["logps"], dtype=torch.float64, requires_grad=True)
        value = fn(logps)
        (grad,) = torch.autograd.grad(value[mask].sum(), logps)
        return value.detach(), grad

    rows = [("sapo per-token loss", "sapo", "loss", "g_loss",
             ours(lambda lp: sapo_loss(lp, old, adv, mask, TAU_POS, TAU_NEG)[0])),
            ("grpo clipped surrogate (eps 0.2)", "grpo", "loss", "g_loss",
             ours(lambda lp: clipped_surrogate_loss(lp, old, adv, mask, EPS, EPS)[0])),
            ("k3 x ratio (use_bias_correction_kl / kl_bias_correction)", "sapo", "kl", "g_kl",
             ours(lambda lp: kl_loss(lp, ref, mask, "k3", old)))]
    print(f"prefzoo vs TRL {theirs['trl']} GRPOTrainer._compute_loss's block, {int(mask.sum())} tokens in "
          f"{mask.shape[0]} completions (float64)\n")
    print("| quantity | max abs difference, value | max abs difference, gradient |")
    print("|---|---|---|")
    worst = 0.0
    for label, loss_type, key, gkey, (value, grad) in rows:
        dv = float((value - torch.tensor(theirs[loss_type][key], dtype=torch.float64))[mask].abs().max())
        dg = float((grad - torch.tensor(theirs[loss_type][gkey], dtype=torch.float64))[mask].abs().max())
        worst = max(worst, dv, dg)
        print(f"| {label} | {dv:.2e} | {dg:.2e} |")
    print(f"\nlargest difference {worst:.2e} ({'agree to 1e-6' if worst <= 1e-6 else 'DIFFER'})")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-side":
        trl_side(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
