"""Toy bandit playground: reward hacking, the inverted U, and pi* — in seconds on a CPU.

``python -m prefzoo.lab.toy`` trains a tabular policy (:mod:`prefzoo.lab.tabular`) over 8 responses to one prompt
with a registered algorithm plugin, unchanged (default: GRPO with the k1 penalty in the reward and
Dr. GRPO's unscaled advantages, whose fixed point is exactly pi*; ``--algo ppo`` reaches the same points),
against a PROXY reward, for a sweep of beta, and measures the GOLD reward of what it learned.
(``--algo dpo`` trains offline on Bradley-Terry pairs of the proxy sampled from pi_ref: it is shown for
comparison only — its logit gaps grow as 1/beta and its view of the rare exploit rests on the ~1% of pairs
that contain it, so with the default steps it matches pi* only for beta >~ 0.5.)

The bandit (:func:`toy_bandit`): responses 0..6 are honest — proxy = gold, rising from 0 to 0.9 — and
response 7 is the EXPLOIT: rare under pi_ref (0.6%), rated 1.2 by the proxy (the best) and 0 by gold.
So pi*_beta = pi_ref exp(proxy/beta) / Z first moves mass to the good responses as beta falls, then,
once beta is small enough to pay the KL price of the rare exploit, onto the exploit.

What it shows (each is checked by ``tests/lab/test_toy.py``):

(a) the inverted U: gold reward against sqrt(KL(pi || pi_ref)) rises, peaks at an intermediate beta,
    then falls, while the proxy reward keeps rising (Gao et al. 2023; the KL penalty's teaching notes);
(b) reward hacking: as beta -> 0 (and at beta = 0, no penalty) the policy puts >= 99% of its mass on
    the exploit;
(c) each trained policy matches the closed form pi*_beta (:func:`prefzoo.objective.optimal_policy`) —
    total variation below ``TV_TOLERANCE`` (at beta = 0 the target is the proxy's argmax).

Outputs: the table on stdout; with ``--out-dir DIR`` also a PNG plot and a markdown page there (the project's own
page is ``--out-dir docs``; nothing is written by default, so a run inside a checkout leaves docs/ alone).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from prefzoo.algos import REGISTRY
from prefzoo.algos.base import Algorithm
from prefzoo.lab.oracles import argmax_policy
from prefzoo.lab.runner import build_algorithm, train_replicas
from prefzoo.lab.tabular import TabularBandit, kl_divergence, total_variation
from prefzoo.objective import optimal_policy

BETAS = (2.0, 1.0, 0.5, 0.3, 0.2, 0.15, 0.1, 0.07, 0.05, 0.03, 0.01, 0.0)
EXPLOIT = 7
TV_TOLERANCE = 0.02  # claim (c); measured residuals are ~1e-3 (see docs/toy_bandit.md)
REPLICAS = 4
SAMPLES_PER_PROMPT = 512  # online: responses per step and replica (32 groups of 16)
PAIRS_PER_PROMPT = 20000  # offline (dpo): Bradley-Terry pairs of the proxy per replica

#: the plugins the toy runs: (config overrides, objective fields) whose fixed point is pi*_beta
SETTINGS = {
    "grpo": (dict(num_samples=16, scale_rewards="none"), dict(kl_estimator="k1", kl_placement="in_reward")),
    "ppo": (dict(num_samples=16), dict(kl_estimator="k1", kl_placement="in_reward")),
    "dpo": ({}, {}),
}


@dataclass
class ToyBandit:
    """One prompt, 8 responses: pi_ref, a proxy reward with an exploit, and the gold reward."""

    bandit: TabularBandit  # rewards = the PROXY (what training sees)
    gold: Tensor  # (1, K) float64

    @property
    def proxy(self) -> Tensor:
        return self.bandit.rewards


def toy_bandit() -> ToyBandit:
    """The bandit of the module docstring."""
    ref_logits = torch.tensor([[1.0, 1.2, 0.8, 0.5, 0.2, 0.0, -0.3, -2.5]])
    gold = torch.tensor([[0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 0.0]], dtype=torch.float64)
    proxy = gold.clone()
    proxy[0, EXPLOIT] = 1.2
    return ToyBandit(TabularBandit(ref_logits, proxy, name="toy"), gold)


def closed_form(toy: ToyBandit, beta: float) -> Tensor:
    """pi*_beta for the proxy, Shape (1, K); at beta = 0 the proxy's argmax (pi_ref restricted to it)."""
    if beta > 0:
        return optimal_policy(toy.bandit.ref_probs, toy.proxy, beta)
    return argmax_policy(toy.bandit)


def make_algorithm(name: str, beta: float) -> Algorithm:
    """The plugin ``name`` set up to optimise E[proxy] - beta KL(pi || pi_ref) with target pi*_beta (:data:`SETTINGS`)."""
    if name not in SETTINGS:
        raise ValueError(f"the toy runs {', '.join(SETTINGS)} (have: {', '.join(sorted(REGISTRY))}), not {name!r}")
    config, objective = SETTINGS[name]
    return build_algorithm(name, config, objective, beta)


def train_toy(toy: ToyBandit, beta: float, algo_name: str = "grpo", replicas: int = REPLICAS, seed: int = 0,
              steps: int = 400, lr: float = 0.2) -> Tensor:
    """Train ``replicas`` independent policies (stacked rows) at ``beta`` with the lab's runner
    (:func:`prefzoo.lab.runner.train_replicas`); returns them, Shape (replicas, K)."""
    if algo_name == "dpo" and beta == 0:
        raise ValueError("DPO has no beta = 0 (the implicit reward is beta log pi/pi_ref)")
    algo = make_algorithm(algo_name, beta)
    return train_replicas(algo, toy.bandit, replicas, seed, steps, lr, samples_per_prompt=SAMPLES_PER_PROMPT,
                          pairs_per_prompt=PAIRS_PER_PROMPT).probs()


@dataclass
class Point:
    """One beta of the sweep: trained (mean over replicas, with standard errors) and closed form."""

    beta: float
    sqrt_kl: float
    sqrt_kl_se: float
    gold: float
    gold_se: float
    proxy: float
    exploit: float
    exploit_min: float
    tv: float
    tv_max: float
    star_sqrt_kl: float
    star_gold: float
    star_proxy: float
    star_exploit: float


def _stats(x: Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std()) / math.sqrt(len(x)) if len(x) > 1 else 0.0


def measure(toy: ToyBandit, beta: float, probs: Tensor) -> Point:
    """Gold/proxy reward, sqrt(KL to pi_ref), exploit mass and TV to pi*_beta of the trained ``probs``."""
    ref = toy.bandit.ref_probs
    star = closed_form(toy, beta)
    kl = kl_divergence(probs, ref.expand_as(probs))
    gold, proxy = (probs * toy.gold).sum(-1), (probs * toy.proxy).sum(-1)
    tv = total_variation(probs, star)
    skl, skl_se = _stats(kl.clamp(min=0).sqrt())
    g, g_se = _stats(gold)
    return Point(beta, skl, skl_se, g, g_se, float(proxy.mean()), float(probs[:, EXPLOIT].mean()),
                 float(probs[:, EXPLOIT].min()), float(tv.mean()), float(tv.max()),
                 float(kl_divergence(star, ref).sqrt()), float((star * toy.gold).sum()),
                 float((star * toy.proxy).sum()), float(star[0, EXPLOIT]))


def sweep(toy: ToyBandit, betas=BETAS, algo_name: str = "grpo", replicas: int = REPLICAS, seed: int = 0,
          steps: int = 400) -> list[Point]:
    """Train and measure every beta (in the order given)."""
    return [measure(toy, b, train_toy(toy, b, algo_name, replicas, seed, steps)) for b in betas
            if not (algo_name == "dpo" and b == 0)]


def markdown_table(points: list[Point]) -> str:
    lines = ["| beta | sqrt(KL) trained | sqrt(KL) π* | gold trained | gold π* | proxy trained | proxy π* | "
             "exploit mass trained (min over seeds) | exploit mass π* | TV(trained, π*) (max) |",
             "|" + "---|" * 10]
    for p in points:
        lines.append(f"| {p.beta:g} | {p.sqrt_kl:.3f} ± {p.sqrt_kl_se:.3f} | {p.star_sqrt_kl:.3f} | "
                     f"{p.gold:.3f} ± {p.gold_se:.3f} | {p.star_gold:.3f} | {p.proxy:.3f} | {p.star_proxy:.3f} | "
                     f"{p.exploit:.4f} ({p.exploit_min:.4f}) | {p.star_exploit:.4f} | {p.tv:.4f} ({p.tv_max:.4f}) |")
    return "\n".join(lines)


CAPTION = ("Toy bandit: gold reward rises then falls against sqrt(KL) as beta decreases (inverted U) while "
           "the proxy keeps rising; the trained policies (markers) sit on the closed-form pi* curve (lines); "
           "as beta -> 0 the exploit takes >= 99% of the mass.")


def plot(toy: ToyBandit, points: list[Point], path: Path, algo_name: str) -> Path:
    """Two panels: reward vs sqrt(KL) (closed-form curves, trained markers), exploit mass vs beta."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = toy.bandit.ref_probs
    fine = torch.logspace(math.log10(0.005), math.log10(20.0), 300).tolist()
    curve = [closed_form(toy, b) for b in fine]
    c_kl = [float(kl_divergence(p, ref).sqrt()) for p in curve]
    c_gold = [float((p * toy.gold).sum()) for p in curve]
    c_proxy = [float((p * toy.proxy).sum()) for p in curve]
    c_exploit = [float(p[0, EXPLOIT]) for p in curve]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    ax1.plot(c_kl, c_gold, color="tab:green", label="gold reward, closed-form π*")
    ax1.plot(c_kl, c_proxy, color="tab:orange", label="proxy reward, closed-form π*")
    ax1.errorbar([p.sqrt_kl for p in points], [p.gold for p in points], yerr=[p.gold_se for p in points],
                 fmt="o", color="darkgreen", label=f"gold reward, trained ({algo_name})")
    ax1.plot([p.sqrt_kl for p in points], [p.proxy for p in points], "s", color="darkorange",
             label=f"proxy reward, trained ({algo_name})")
    peak = max(points, key=lambda p: p.gold)
    for p in points:
        if p.beta in (2.0, 0.5, peak.beta, 0.1, 0.0):
            ax1.annotate(f"β={p.beta:g}", (p.sqrt_kl, p.gold), textcoords="offset points",
                         xytext=(-30, 22) if p.beta == 0 else (4, -12), fontsize=8,
                         arrowprops=dict(arrowstyle="-", lw=0.6) if p.beta == 0 else None)
    ax1.set_xlabel("sqrt(KL(π ‖ π_ref))  (nats^½)")
    ax1.set_ylabel("expected reward")
    ax1.set_title("(a) gold peaks at intermediate KL; proxy keeps rising")
    ax1.legend(fontsize=8, loc="upper left")
    ax1.grid(alpha=0.3)

    ax2.semilogx(fine, c_exploit, color="tab:red", label="closed-form π*")
    pos = [p for p in points if p.beta > 0]
    ax2.plot([p.beta for p in pos], [p.exploit for p in pos], "o", color="darkred", label=f"trained ({algo_name})")
    zero = [p for p in points if p.beta == 0]
    if zero:
        ax2.plot([min(fine)], [zero[0].exploit], "x", color="black", markersize=9,
                 label="trained, β = 0 (no penalty; drawn at the left edge)")
    ax2.axhline(0.99, color="gray", ls="--", lw=1, label="99%")
    ax2.set_xlabel("β")
    ax2.set_ylabel("mass on the exploit")
    ax2.set_title("(b) β → 0: the exploit takes the mass; (c) trained = π*")
    ax2.legend(fontsize=8, loc="center right")
    ax2.grid(alpha=0.3)
    fig.suptitle(CAPTION, fontsize=9, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefzoo.lab.toy", description=__doc__.split("\n")[0])
    parser.add_argument("--algo", default="grpo", help="grpo (default), ppo or dpo")
    parser.add_argument("--out-dir", default=None,
                        help="where toy_bandit.png and toy_bandit.md go (default: none, the table is printed)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    toy = toy_bandit()
    points = sweep(toy, BETAS, args.algo, REPLICAS, args.seed, args.steps)
    seconds = time.perf_counter() - started
    table = markdown_table(points)
    if args.out_dir is None:
        print(table)
        print(f"[toy] {seconds:.1f} s; nothing written (--out-dir DIR writes the plot and the page there)")
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.algo == "grpo" else f"_{args.algo}"
    png = plot(toy, points, out / f"toy_bandit{suffix}.png", args.algo)
    peak = max(points, key=lambda p: p.gold)
    command = f"python -m prefzoo toy --out-dir {args.out_dir}" + ("" if args.algo == "grpo" else f" --algo {args.algo}")
    exploit_ref = float(toy.bandit.ref_probs[0, EXPLOIT])
    doc = f"""# Toy bandit: reward hacking and the inverted U

`{command}` ({seconds:.0f} s on CPU, {REPLICAS} seeds per beta,
{args.steps} steps, plugin `{args.algo}` unchanged on the tabular policy). π_ref over 8 responses; responses 0-6 are
honest (proxy = gold = 0, 0.15, ..., 0.9); response {EXPLOIT} is the exploit (π_ref = {exploit_ref:.4f},
proxy 1.2, gold 0). Training sees only the proxy.

![toy bandit]({png.name})

{CAPTION}

Gold reward peaks at β = {peak.beta:g} (gold {peak.gold:.3f}, sqrt(KL) {peak.sqrt_kl:.3f}); trained policies are
within TV {max(p.tv_max for p in points):.4f} of the closed form (tolerance {TV_TOLERANCE}).

{table}
"""
    md = out / f"toy_bandit{suffix}.md"
    md.write_text(doc)
    print(table)
    print(f"[toy] {seconds:.1f} s; wrote {png} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
