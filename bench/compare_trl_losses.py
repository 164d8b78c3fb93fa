"""prefzoo's SAPO loss and bias-corrected KL against TRL 1.16's, on identical log-probs: values and gradients; and the
policy-loss options of issue 48 (the two-sided clip, VESPO with and without the sampler's weights, LUSPO, the
off-policy sequence mask, the high-entropy token mask), each as the whole step's loss and its gradient.

    make setup-bench-trl                                   # bench/.venv-trl with trl 1.16.0 (once)
    .venv/bin/python bench/compare_trl_losses.py           # prints the table; exit status 1 if a value differs

What is compared. TRL computes both inline in ``GRPOTrainer._compute_loss``, so the TRL side reads that method's source
from the installed trl, cuts the block from ``log_ratio = per_token_logps - old_per_token_logps`` to the
``elif self.loss_type == "vespo":`` branch (the ratio, the KL with ``use_bias_correction_kl``, and the cispo / grpo /
sapo per-token losses) and runs it with ``self`` carrying the settings: TRL's own code runs, not a transcription. Its
outputs: ``per_token_loss`` and ``per_token_kl``, and their gradients (summed over the mask) with respect to the
policy's log-probs. prefzoo's side: :func:`prefzoo.objective.sapo_loss` and :func:`prefzoo.objective.kl_loss` with
``old_logps`` (``objective.kl_bias_correction``), and ``clipped_surrogate_loss`` for TRL's ``grpo`` loss type.

The options. TRL's ``_compute_loss`` block from ``log_ratio = ...`` to the entropy bonus (the loss types, both masks
and the reduction of each loss type) runs with ``self`` carrying the settings; its masks come from TRL's own
``get_off_policy_mask`` and ``get_high_entropy_mask`` (with a one-process stand-in for the accelerator). prefzoo's side
composes its objective functions as the online family does (:func:`prefzoo.algos.online.mask_policy_term`, then the KL
term) and reduces with :func:`prefzoo.objective.aggregate_loss`: TRL's ``grpo`` reduction is ``sequence_mean``, its
``dapo``/``vespo`` ones ``token_mean`` (one process, no accumulation), ``luspo`` ``sequence_sum``.

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
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64) * 3.0
    is_ratio = torch.where(mask.bool(), torch.rand(b, t, generator=g, dtype=torch.float64) + 0.5, torch.ones(b, t, dtype=torch.float64))
    return {"logps": new.tolist(), "old": old.tolist(), "ref": ref.tolist(), "adv": adv.tolist(), "mask": mask.tolist(),
            "entropy": entropy.tolist(), "is_ratio": is_ratio.tolist()}


#: the options compared as a whole step's loss: name -> TRL's settings (prefzoo's side is in ``main``)
OPTIONS = {
    "two-sided clip (delta 1.3), beta 0.04": dict(loss_type="grpo", delta=1.3, beta=0.04),
    "vespo": dict(loss_type="vespo"),
    "vespo with the sampler's token weights": dict(loss_type="vespo", is_ratio=True),
    "luspo (sequence-level ratio)": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "off-policy sequence mask (0.02), beta 0.04": dict(loss_type="grpo", off_policy_mask_threshold=0.02, beta=0.04),
    "top_entropy_quantile 0.2": dict(loss_type="dapo", top_entropy_quantile=0.2),
}


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
    out["options"] = trl_options(data)
    Path(outfile).write_text(json.dumps(out))


def trl_options(data: dict) -> dict:
    """Under TRL's interpreter: each of :data:`OPTIONS` through TRL's block, its masks from TRL's own methods."""
    import inspect
    import textwrap
    from types import SimpleNamespace

    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)
    start = source.index("log_ratio = per_token_logps - old_per_token_logps")
    stop = source.index("# Entropy bonus", start)
    block = textwrap.dedent(source[source.rfind("\n", 0, start) + 1:source.rfind("\n", 0, stop) + 1])
    code = compile(block, "trl_compute_loss_block", "exec")
    accelerator = SimpleNamespace(num_processes=1, pad_across_processes=lambda x, **_: x, gather=lambda x: x)
    results = {}
    for name, opt in OPTIONS.items():
        args = SimpleNamespace(use_bias_correction_kl=True, delta=opt.get("delta"), vespo_k_pos=2.0,
                               vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1,
                               sapo_temperature_pos=TAU_POS, sapo_temperature_neg=TAU_NEG)
        me = SimpleNamespace(importance_sampling_level=opt.get("importance_sampling_level", "token"),
                             beta=opt.get("beta", 0.0), args=args, loss_type=opt["loss_type"], epsilon_low=EPS,
                             epsilon_high=EPS, get_gamma_weights=GRPOTrainer.get_gamma_weights,
                             off_policy_mask_threshold=opt.get("off_policy_mask_threshold"), use_vllm=False,
                             vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
                             current_gradient_accumulation_steps=1, accelerator=accelerator, max_completion_length=8)
        logps = torch.tensor(data["logps"], dtype=torch.float64, requires_grad=True)
        old = torch.tensor(data["old"], dtype=torch.float64)
        mask = torch.tensor(data["mask"], dtype=torch.float64)
        adv = torch.tensor(data["adv"], dtype=torch.float64)[:, None]
        entropy_mask = None
        if opt.get("top_entropy_quantile", 1.0) < 1.0:
            entropy_mask = GRPOTrainer.get_high_entropy_mask(me, torch.tensor(data["entropy"], dtype=torch.float64),
                                                             mask, 1 - opt["top_entropy_quantile"])
        inputs = {"ref_per_token_logps": torch.tensor(data["ref"], dtype=torch.float64),
                  "num_items_in_batch": mask.sum()}
        if opt.get("is_ratio"):
            inputs["importance_sampling_ratio"] = torch.tensor(data["is_ratio"], dtype=torch.float64)
        scope = {"self": me, "torch": torch, "per_token_logps": logps, "old_per_token_logps": old,
                 "advantages": adv, "mask": mask, "inputs": inputs, "entropy_mask": entropy_mask}
        if me.off_policy_mask_threshold is not None:
            scope["off_policy_mask"] = GRPOTrainer.get_off_policy_mask(adv, logps, old, mask, me.off_policy_mask_threshold)
        exec(code, scope)
        (grad,) = torch.autograd.grad(scope["loss"], logps)
        results[name] = {"loss": scope["loss"].item(), "grad": grad.tolist(),
                         "kept": None if entropy_mask is None else entropy_mask.tolist()}
    return results


def ours_options(data: dict) -> dict:
    """prefzoo's side of :data:`OPTIONS`: (loss, gradient) of each, from its objective functions."""
    import torch

    from prefzoo.objective import (aggregate_loss, clipped_surrogate_loss, high_entropy_mask, kl_loss,
                                   loss_normaliser, off_policy_sequence_mask, sequence_clipped_surrogate_loss,
                                   vespo_loss)

    mask = torch.tensor(data["mask"]).bool()
    old, ref = torch.tensor(data["old"], dtype=torch.float64), torch.tensor(data["ref"], dtype=torch.float64)
    adv = torch.tensor(data["adv"], dtype=torch.float64)
    entropy, is_ratio = (torch.tensor(data[k], dtype=torch.float64) for k in ("entropy", "is_ratio"))

    def kl(lp, beta):
        return beta * kl_loss(lp, ref, mask, "k3", old)

    def reduce(per_token, aggregation):
        return aggregate_loss(per_token, mask, aggregation, loss_normaliser(mask, aggregation))

    def zero_unless(keep, per_token):
        return torch.where(keep, per_token, torch.zeros_like(per_token))

    build = {
        "two-sided clip (delta 1.3), beta 0.04": lambda lp: reduce(
            clipped_surrogate_loss(lp, old, adv, mask, EPS, EPS, ratio_max=1.3)[0] + kl(lp, 0.04), "sequence_mean"),
        "vespo": lambda lp: reduce(vespo_loss(lp, old, adv, mask)[0], "token_mean"),
        "vespo with the sampler's token weights": lambda lp: reduce(
            vespo_loss(lp, old, adv, mask, is_weights=is_ratio)[0], "token_mean"),
        "luspo (sequence-level ratio)": lambda lp: reduce(
            sequence_clipped_surrogate_loss(lp, old, adv, mask, EPS, EPS)[0], "sequence_sum"),
        "off-policy sequence mask (0.02), beta 0.04": lambda lp: reduce(
            zero_unless(off_policy_sequence_mask(lp, old, adv, mask, 0.02)[0],
                        clipped_surrogate_loss(lp, old, adv, mask, EPS, EPS)[0]) + kl(lp, 0.04), "sequence_mean"),
        "top_entropy_quantile 0.2": lambda lp: reduce(
            zero_unless(high_entropy_mask(entropy, mask, 0.2), clipped_surrogate_loss(lp, old, adv, mask, EPS, EPS)[0]),
            "token_mean"),
    }
    out = {}
    for name, fn in build.items():
        logps = torch.tensor(data["logps"], dtype=torch.float64, requires_grad=True)
        loss = fn(logps)
        (grad,) = torch.autograd.grad(loss, logps)
        out[name] = (loss.item(), grad)
    ratio = (torch.tensor(data["logps"], dtype=torch.float64) - old).exp()
    out["capped by delta"] = int(((ratio > 1.3) & (adv[:, None] < 0) & mask).sum())
    out["dropped by the off-policy mask"] = int((~off_policy_sequence_mask(
        torch.tensor(data["logps"], dtype=torch.float64), old, adv, mask, 0.02)[0] & mask).any(-1).sum())
    out["kept by the entropy mask"] = high_entropy_mask(entropy, mask, 0.2)
    return out


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
    mine = ours_options(data)
    print("\n| option (the whole step's loss) | loss, prefzoo | loss, TRL | abs difference, loss | max abs difference, "
          "gradient |")
    print("|---|---|---|---|---|")
    for name, trl in theirs["options"].items():
        loss, grad = mine[name]
        dl = abs(loss - trl["loss"])
        dg = float((grad - torch.tensor(trl["grad"], dtype=torch.float64))[mask].abs().max())
        worst = max(worst, dl, dg)
        print(f"| {name} | {loss:.6f} | {trl['loss']:.6f} | {dl:.2e} | {dg:.2e} |")
    kept = theirs["options"]["top_entropy_quantile 0.2"]["kept"]
    same = mine["kept by the entropy mask"].tolist() == [[bool(v) for v in row] for row in kept]
    worst = worst if same else float("inf")
    print(f"\nthe two-sided clip capped {mine['capped by delta']} tokens (ratio > 1.3, A < 0); the off-policy mask dropped {mine['dropped by the off-policy mask']} of {mask.shape[0]} sequences; the "
          f"entropy mask kept {int(mine['kept by the entropy mask'].sum())} of {int(mask.sum())} tokens, "
          f"{'the same tokens as TRL' if same else 'NOT the tokens TRL kept'}")
    print(f"\nlargest difference {worst:.2e} ({'agree to 1e-6' if worst <= 1e-6 else 'DIFFER'})")
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-side":
        trl_side(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
