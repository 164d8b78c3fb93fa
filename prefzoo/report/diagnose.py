"""The beta doctor: what a run's KL penalty did, read from its folder, with the numbers behind each statement.

``prefzoo diagnose RUN_DIR`` (or ``python -m prefzoo.diagnose RUN_DIR``) reads a run folder -- ``metrics.jsonl``
(one line per training step), the held-out evaluations (``summary.json``'s ``eval_history``, or the
``eval_*.json`` files of a run still going) and ``config.yaml`` -- and says whether the policy is

* **not moving**: KL(pi || pi_ref) and the log-ratio margin near 0 after its steps (note 000 sec. 4.1: with a
  large beta "the policy cannot move"), and whether the numbers point at beta, the learning rate or the reward;
* **drifting**: KL past its budget (note 000 sec. 5, "the KL budget") and whether it still grows; or the gold
  reward falling while the proxy rises (Gao et al. 2023; note 004, "Over-optimisation, quantified");
* **verbose**: completions longer, more of them cut at ``rollout.max_new_tokens`` (note 000 sec. 2.1);
* **repetitive**: distinct-n down since the first evaluation (Kirk et al. 2024; note 004, "Mode-seeking");
* **collapsing**: entropy down sharply, one answer per prompt, or accuracy at ~0 with KL past its budget
  (note 000 sec. 2.2);
* **healthy** when none of these fire;

each followed by the change to try, in the config keys of :mod:`prefzoo.config` (note 000 exercise (d): a policy
that hardly moves at a large beta, verbose and repetitive at a small one). "The start" and "the end" of a run are
the first and last :data:`WINDOW` of its logged steps, or its first and last evaluation. The thresholds are the
constants below, each with where it comes from; the command's flags override the ones a user would tune.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from prefzoo.errors import DataError, PrefzooError, RunFolderError
from prefzoo.training.layout import CONFIG_FILE, EVAL_FILE, METRICS_FILE, SUMMARY_FILE

__all__ = ["Finding", "Limits", "Run", "load_run", "diagnose", "render", "main"]

MIN_STEPS = 5
"""Fewest logged training steps the doctor judges: a start and an end window of at least one step each, past the
default warm-up (``trainer.warmup_steps=2``). Rule of thumb; ``--min-steps``."""
WINDOW = 0.25
"""Share of the logged steps averaged as the start and as the end of a run, and over which the KL's slope is fitted
(at least 1 step, 3 for a slope). Rule of thumb: a quarter smooths step-to-step noise and still sees the trend."""
NOT_MOVING_KL = 0.1
"""KL(pi || pi_ref) below this (nats per completion): not moving. A completion is then on average e^0.1 = 1.1 times
as likely under the policy as under the reference. Rule of thumb; ``--not-moving-kl``."""
NOT_MOVING_MARGIN = 0.1
"""Offline: |rewards/margins| / beta below this (nats): the chosen and rejected log-ratios have not parted
(``rewards/margins`` is beta times that log-ratio margin, as in TRL and DESIGN.md). Same rule as NOT_MOVING_KL."""
HIGH_BETA = 0.5
"""A beta at or above this is large (note 000 sec. 4.1: the KL term dominates). Published recipes use 0.01 to 0.1
(InstructGPT 0.02, DPO's 0.1; note 000 sec. 4 lost its own numbers in conversion): 0.5 is 5 times the largest."""
LOSS_FLAT = 0.05
"""The loss moved by less than this share of its start value: the weights barely moved (lr too low); it fell by
more while the margin stayed under NOT_MOVING_MARGIN: beta turns small moves into a low loss. Rule of thumb."""
ZERO_GRAD = 1e-8
"""grad_norm at or below this over the end window: no gradient at all (e.g. GRPO groups that all got one reward)."""
DEFAULT_KL_BUDGET = 6.0
"""KL budget (nats per completion) when the run sets none (``objective.kl_budget``, or ``objective.kl_target`` under
the adaptive controller): the adaptive-KL target of Ziegler et al. 2019 as TRL's PPOConfig ships it (``target=6``,
``horizon=10000``, which prefzoo's ``objective.kl_horizon`` copies). Note 000 sec. 5 gives "typically ... nats per
completion", its number lost; note 004: a fixed beta fixes the price of divergence, not the divergence.
``--kl-budget``."""
GROWING = 0.05
"""Still growing: the KL's least-squares slope over the end window, times the window's length in steps, is more than
this share of the latest KL (it rose by more than 5% in the last quarter). Rule of thumb."""
GOLD_DROP_SE = 2.0
"""Gold fell from its peak: by more than this many standard errors of the difference (two: about 95% one-sided)..."""
GOLD_DROP_REL = 0.05
"""... or, when the evaluations carry no standard errors, by more than this share of the peak. Rules of thumb."""
VERBOSE_RATIO = 1.5
"""Completion length at the end at least this many times the start: verbose (note 000 sec. 2.1's length hacking;
rule of thumb). ``--length-ratio``."""
TRUNCATION_RISE = 0.10
"""The share of rollouts cut at ``rollout.max_new_tokens`` (``frac_truncated``) up by this much (absolute). Rule of
thumb: one completion in ten more hits the cap."""
DISTINCT_DROP = 0.2
"""distinct-n down by this share (relative) from the first evaluation to the last: repetitive (Kirk et al. 2024
measure RLHF's diversity loss in distinct-n; note 004). Rule of thumb; ``--distinct-drop``."""
ENTROPY_DROP = 0.5
"""Per-token entropy down by this share: collapsing ("down sharply": halved; issue 16's PPO at beta = 0 on VADER went
2.94 -> 1.10 nats, -63%). Rule of thumb; ``--entropy-drop``."""
ONE_ANSWER = 1.25
"""distinct-2 at or below ONE_ANSWER / G (G = ``eval.diversity_samples`` per prompt): one answer per prompt. G equal
samples give exactly 1/G (:mod:`prefzoo.evaluation.diversity` counts across one prompt's samples); 1.25 / G leaves
room for a few differing words."""
ZERO_ACCURACY = 0.02
"""task_accuracy at or below this with KL past its budget: collapsed (/work/runs/zoo/kto: 0.000 at KL 50 nats; the base
SmolLM2 answers about 22% of two-digit sums, DESIGN.md)."""
REFERENCE_FREE = frozenset({"orpo", "simpo", "sft"})
"""For run folders written before summary.json recorded the plugin's declaration (``reference``, ``capabilities``):
the algorithms whose loss has no KL to a reference (DESIGN.md's table); their beta weighs some other term, so the
doctor suggests no beta change there."""
ADAPTIVE_BETA = frozenset({"ppo"})
"""For such older folders: the algorithms declaring ``adaptive_beta`` (they update the adaptive controller)."""


@dataclass(frozen=True)
class Limits:
    """The thresholds a user may override (flags of the same names); the rest are the module's constants."""

    kl_budget: float | None = None  # None: the run's objective.kl_budget / kl_target, else DEFAULT_KL_BUDGET
    min_steps: int = MIN_STEPS
    not_moving_kl: float = NOT_MOVING_KL
    length_ratio: float = VERBOSE_RATIO
    distinct_drop: float = DISTINCT_DROP
    entropy_drop: float = ENTROPY_DROP


@dataclass
class Finding:
    """One verdict (``not_moving``, ``drifting``, ``verbose``, ``repetitive``, ``collapsing``, ``healthy`` or
    ``too_few_steps``), the evidence in words and numbers, and the change to try."""

    verdict: str
    evidence: str
    change: str
    numbers: dict = field(default_factory=dict)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Run:
    """A run folder: its step metrics, its evaluations (each with its ``step``), its config and summary."""

    dir: Path
    steps: list[dict]
    evals: list[dict]
    config: dict
    summary: dict

    def setting(self, dotted: str, default=None):
        node = self.config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return default if node is None else node

    @property
    def algo(self) -> str:
        return str(self.setting("algo.name", self.summary.get("algo", "?")))

    @property
    def beta(self) -> float:
        logged = [r["beta"] for r in self.steps if _number(r.get("beta"))]
        if logged:
            return float(logged[-1])  # the adaptive controller's latest value
        return float(self.summary.get("final_beta") or self.setting("objective.beta", 0.0) or 0.0)

    @property
    def reference_free(self) -> bool:
        """The loss has no KL term to a reference whatever beta is: the plugin declared no reference (summary.json's
        ``reference``; older folders: :data:`REFERENCE_FREE`), except an online run at beta 0: GRPO and the other
        sampled plugins build no reference when nothing penalises the KL, but their beta is the KL coefficient, so
        the advice there is to raise it."""
        declared = not self.summary["reference"] if "reference" in self.summary else self.algo in REFERENCE_FREE
        return declared and not (self.online and self.beta == 0)

    @property
    def adapts_beta(self) -> bool:
        """The plugin declared ``adaptive_beta`` (summary.json's ``capabilities``; older: :data:`ADAPTIVE_BETA`)."""
        if "capabilities" in self.summary:
            return "adaptive_beta" in self.summary["capabilities"]
        return self.algo in ADAPTIVE_BETA

    @property
    def online(self) -> bool:
        """Trained on its own rollouts: the step metric ``kl`` is then KL(pi || pi_ref) on them (KTO's is not)."""
        if self.summary:
            return (self.summary.get("results") or {}).get("train_kl") is not None
        return any("completion_length" in r for r in self.steps)


def load_run(run_dir) -> Run:
    """Read a run folder (see the module docstring).

    Raises:
        RunFolderError: the folder has neither ``metrics.jsonl`` nor ``summary.json``.
        DataError: a line of ``metrics.jsonl``, ``summary.json`` or an ``eval_*.json`` is not a JSON object.
    """
    run_dir = Path(run_dir)
    metrics, summary_path = run_dir / METRICS_FILE, run_dir / SUMMARY_FILE
    if not metrics.is_file() and not summary_path.is_file():
        what = "does not exist" if not run_dir.exists() else "has neither metrics.jsonl nor summary.json"
        raise RunFolderError(f"{run_dir} is not a run folder: it {what}. A training run writes metrics.jsonl as it "
                             "trains and summary.json when it ends; give the folder a run printed as 'run folder:'.")
    steps = []
    for number, line in enumerate(metrics.read_text().splitlines() if metrics.is_file() else [], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{metrics}:{number}: not a JSON object ({err.msg}); each line of metrics.jsonl is one "
                            "training step's metrics, as the loop writes them.") from None
        if not isinstance(row, dict) or not _number(row.get("step")):
            raise DataError(f"{metrics}:{number}: a line without a numeric 'step' ({line[:60]!r}); each line of "
                            "metrics.jsonl is one training step's metrics, as the loop writes them.")
        steps.append(row)
    summary = _read_json(summary_path) if summary_path.is_file() else {}
    evals = summary.get("eval_history") or _eval_files(run_dir, steps[-1]["step"] if steps else 0)
    config_path = run_dir / CONFIG_FILE
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    return Run(run_dir, steps, sorted(evals, key=lambda e: e["step"]), config, summary)


def _eval_files(run_dir: Path, last_step: int) -> list[dict]:
    """A run without a summary yet: ``eval_before.json`` (step 0), ``eval_step<N>.json``, ``eval_after.json``."""
    out = []
    for path in sorted(run_dir.glob(EVAL_FILE.format(tag="*"))):
        tag = path.stem[len(EVAL_FILE.format(tag="")[:-len(".json")]):]
        found = re.fullmatch(r"step(\d+)", tag)
        step = 0 if tag == "before" else int(found.group(1)) if found else last_step if tag == "after" else None
        if step is not None:
            out.append({"step": step, "tag": tag, **_read_json(path)})
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not JSON ({err.msg} at line {err.lineno}); the run may have been cut off while "
                        "writing it: run the evaluation again or delete the file.") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: holds a {type(data).__name__}, not the JSON object a run writes there.")
    return data


# ------------------------------------------------------------------------------------------------ series
def series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every row with a finite number under ``key``."""
    return [(float(r["step"]), float(r[key])) for r in rows if _number(r.get(key))]


def _window(points: list, share: float = WINDOW) -> int:
    return max(1, round(len(points) * share))


def _mean(points) -> float:
    return sum(v for _, v in points) / len(points)


def _span(points) -> str:
    return f"{points[0][0]:g}" if len(points) == 1 else f"{points[0][0]:g}-{points[-1][0]:g}"


@dataclass
class Change:
    """A metric at the start and at the end of a run, and where both were read."""

    first: float
    last: float
    where: str


def start_and_end(run: Run, key: str, evals_only: bool = False) -> Change | None:
    """``key`` at the first and last evaluation (two or more), else the mean of the first and last window of steps."""
    held = series(run.evals, key)
    if len(held) >= 2:
        return Change(held[0][1], held[-1][1], f"evaluations at steps {held[0][0]:g} and {held[-1][0]:g}")
    stream = [] if evals_only else series(run.steps, key)
    if len(stream) < 2:
        return None
    k = _window(stream)
    head, tail = stream[:k], stream[-k:]
    return Change(_mean(head), _mean(tail), f"training steps {_span(head)} vs {_span(tail)}")


def slope(points) -> float:
    """Least-squares slope of value against step (units per step)."""
    n = len(points)
    mx, my = sum(s for s, _ in points) / n, _mean(points)
    sxx = sum((s - mx) ** 2 for s, _ in points)
    return sum((s - mx) * (v - my) for s, v in points) / sxx if sxx else 0.0


def kl_points(run: Run) -> list[tuple[float, float]]:
    """KL(pi || pi_ref) measurements (nats per completion): each step's rollouts (online), else the evaluations'."""
    stream = series(run.steps, "kl") if run.online else []
    held = series(run.evals, "kl_k1")
    return stream if len(stream) > len(held) else held


def latest_kl(run: Run) -> tuple[float, str] | None:
    """The latest KL measurement and where it was read: the last evaluation if it is at (or after) the last step,
    else the mean of the last window of rollouts (online), else the last evaluation."""
    held = series(run.evals, "kl_k1")
    stream = series(run.steps, "kl") if run.online else []
    if held and (not stream or held[-1][0] >= stream[-1][0]):
        return held[-1][1], f"held-out evaluation at step {held[-1][0]:g}"
    if stream:
        tail = stream[-_window(stream):]
        return _mean(tail), f"rollouts of steps {_span(tail)}"
    return None


def budget_of(run: Run, limits: Limits) -> tuple[float, str]:
    if limits.kl_budget is not None:
        return limits.kl_budget, "--kl-budget"
    if run.setting("objective.kl_budget") is not None:
        return float(run.setting("objective.kl_budget")), "objective.kl_budget"
    if run.setting("objective.kl_controller") == "adaptive" and run.setting("objective.kl_target") is not None:
        return float(run.setting("objective.kl_target")), "objective.kl_target of the adaptive controller"
    return DEFAULT_KL_BUDGET, "the default; --kl-budget sets another"


# ------------------------------------------------------------------------------------------------ changes
def penalty_change(run: Run, budget: float) -> str:
    """The change that holds the policy closer to its reference, in this run's keys."""
    lr = float(run.setting("trainer.lr", 2e-4))
    if run.reference_free:
        return (f"algo={run.algo}'s loss has no KL term (its objective.beta weighs another one): lower trainer.lr "
                f"({lr:g} -> {lr / 4:g}) or stop earlier, or use an algorithm with a KL penalty (algo=dpo)")
    if run.setting("objective.kl_controller") == "adaptive":
        target, horizon = run.setting("objective.kl_target"), int(run.setting("objective.kl_horizon", 10000))
        return (f"the adaptive controller lags: objective.kl_horizon {horizon} -> {max(1, horizon // 10)} "
                f"(it reacts sooner), or a lower objective.kl_target (now {target:g})")
    if run.adapts_beta:
        other = f", or objective.kl_controller=adaptive objective.kl_target={budget:g}"
    else:
        other = f", or objective.kl_budget={budget:g} to stop there" + ("" if run.online else " (with eval.every=N)")
    if run.beta == 0:
        return f"objective.beta=0.04 (now 0: no KL penalty; DeepSeekMath's GRPO used 0.04){other}"
    return f"objective.beta {run.beta:g} -> {2 * run.beta:g} (note 004: it fixes the price of KL, not the KL){other}"


# ------------------------------------------------------------------------------------------------ the checks
def not_moving(run: Run, limits: Limits, budget: float) -> Finding | None:
    kl = latest_kl(run)
    kl = None if kl is None else (abs(kl[0]), kl[1])  # a k1 estimate near 0 can come out a hair below it
    margins = [] if run.online else series(run.steps, "rewards/margins")
    margin = abs(_mean(margins[-_window(margins):])) / run.beta if margins and run.beta > 0 else None
    if (kl is None and margin is None) or (kl is not None and kl[0] >= limits.not_moving_kl) \
            or (margin is not None and margin >= NOT_MOVING_MARGIN):
        return None
    facts, numbers = [], {}
    if kl is not None:
        facts.append(f"KL {kl[0]:.3g} nats per completion ({kl[1]}; < {limits.not_moving_kl:g})")
        numbers["kl"] = kl[0]
    if margin is not None:
        facts.append(f"log-ratio margin {margin:.3g} nats (rewards/margins / beta {run.beta:g}; "
                     f"< {NOT_MOVING_MARGIN:g})")
        numbers["margin_nats"] = margin
    pref = start_and_end(run, "preference_accuracy", evals_only=True)
    if pref:
        facts.append(f"preference accuracy {pref.first:.3g} -> {pref.last:.3g}")
    loss, grad = start_and_end(run, "loss"), series(run.steps, "grad_norm")
    moved = None  # offline only: an online loss is advantage-weighted, about 0 by construction
    if loss and loss.first and not run.online:
        moved = (loss.last - loss.first) / abs(loss.first)
        numbers["loss"] = [loss.first, loss.last]
    lr, causes, changes, numbers["suggests"] = float(run.setting("trainer.lr", 2e-4)), [], [], []
    if grad and max(v for _, v in grad[-_window(grad):]) <= ZERO_GRAD:
        zero = start_and_end(run, "frac_zero_std_groups")
        causes.append(f"grad_norm 0 over steps {_span(grad[-_window(grad):])}"
                      + (f", frac_zero_std_groups {zero.last:.3g}" if zero else "")
                      + ": no learning signal, neither beta nor lr")
        changes.append("a reward that tells this model's samples apart: raise rollout.temperature or algo.num_samples, "
                       "or an easier task / a reward with partial credit")
        numbers["suggests"].append("reward")
    else:
        fell = moved is not None and margin is not None and moved <= -LOSS_FLAT
        high, flat = run.beta >= HIGH_BETA or fell, moved is not None and abs(moved) < LOSS_FLAT
        if high:
            causes.append(f"beta {run.beta:g}" + (f" >= {HIGH_BETA:g}" if run.beta >= HIGH_BETA else "")
                          + (f", loss {loss.first:.3g} -> {loss.last:.3g} ({moved:+.0%}) with the margin still near 0"
                             if fell else "") + ": beta too high")
            changes.append(f"objective.beta {run.beta:g} -> {run.beta / 10:g}")
            numbers["suggests"].append("beta")
        if flat:
            causes.append(f"loss {loss.first:.3g} -> {loss.last:.3g} ({moved:+.1%}, {loss.where}): the weights barely "
                          "moved, lr too low")
        elif not high:
            causes.append(f"beta {run.beta:g} < {HIGH_BETA:g} is not what holds it: lr too low")
        if flat or not high:
            changes.append(f"trainer.lr {lr:g} -> {10 * lr:g} (or more trainer.max_steps)")
            numbers["suggests"].append("lr")
    steps = len(run.steps)
    return Finding("not_moving", f"after {steps} steps " + ", ".join(facts) + "; " + "; ".join(causes),
                   "; or ".join(changes), numbers)


def drifting(run: Run, limits: Limits, budget: float) -> Finding | None:
    kl = latest_kl(run)
    if kl is None or kl[0] <= budget:
        return None
    points = kl_points(run)
    numbers = {"kl": kl[0], "budget": budget}
    if len(points) >= 3:
        tail = points[-max(3, _window(points)):]
        rate = slope(tail)
        growing = rate * (tail[-1][0] - tail[0][0]) > GROWING * kl[0]
        numbers["slope"] = rate
        trend = f"{'still growing' if growing else 'levelled off'}: {rate:+.3g} nats/step over steps {_span(tail)}"
    else:
        trend = "its trend is unknown (one KL measurement" + ("" if run.online else "; eval.every=N measures it while "
                                                           "training") + ")"
    change = penalty_change(run, budget)
    if run.setting("objective.kl_budget") is None and run.adapts_beta:
        change += f"; objective.kl_budget={budget:g} stops the run there"
    return Finding("drifting", f"KL {kl[0]:.3g} nats per completion ({kl[1]}) is past the budget of {budget:g}; "
                   f"{trend}", change, numbers)


def gold_vs_proxy(run: Run, limits: Limits, budget: float) -> Finding | None:
    for gold, proxy in (("gold_sample_reward", "sample_reward"), ("gold_task_reward", "task_reward")):
        rows = [e for e in run.evals if _number(e.get(gold)) and _number(e.get(proxy))]
        if len(rows) >= 2:
            break
    else:
        return None
    peak = max(range(len(rows)), key=lambda i: rows[i][gold])
    top, end = rows[peak], rows[-1]
    if peak == len(rows) - 1 or end[proxy] <= top[proxy]:
        return None
    drop = top[gold] - end[gold]
    se = math.hypot(top.get(f"{gold}_se") or 0.0, end.get(f"{gold}_se") or 0.0)
    if not (drop > GOLD_DROP_SE * se if se > 0 else drop > GOLD_DROP_REL * abs(top[gold])):
        return None
    kl = top.get("kl_k1")
    at = f", KL {kl:.3g}" if _number(kl) else ""
    fell = f" ({drop / se:.1f} standard errors)" if se > 0 else ""
    budget_hint = f" or objective.kl_budget={kl:.3g} (the KL at the peak)," if _number(kl) and kl > 0 else ""
    evidence = (f"{gold} peaked at step {top['step']:g} ({top[gold]:.3g}{at}) and fell to {end[gold]:.3g} at step "
                f"{end['step']:g}{fell} while the proxy {proxy} rose {top[proxy]:.3g} -> {end[proxy]:.3g}")
    change = (f"stop where the gold peaked: trainer.max_steps={top['step']:g},{budget_hint} or "
              f"trainer.early_stopping.metric={gold} (keeps the best weights in best/); a larger objective.beta only "
              "slows the travel along the same curve (note 004)")
    return Finding("drifting", evidence, change,
                   {"peak_step": top["step"], "gold_peak": top[gold], "gold_last": end[gold],
                    "proxy_at_peak": top[proxy], "proxy_last": end[proxy]})


def verbose(run: Run, limits: Limits, budget: float) -> Finding | None:
    length, cut = start_and_end(run, "completion_length"), start_and_end(run, "frac_truncated")
    facts, numbers = [], {}
    if length and length.first > 0 and length.last / length.first >= limits.length_ratio:
        facts.append(f"completion_length {length.first:.3g} -> {length.last:.3g} tokens "
                     f"(x{length.last / length.first:.2f}, {length.where})")
        numbers["completion_length"] = [length.first, length.last]
    if cut and cut.last - cut.first >= TRUNCATION_RISE:
        facts.append(f"share cut at rollout.max_new_tokens (frac_truncated) {cut.first:.2f} -> {cut.last:.2f} "
                     f"({cut.where})")
        numbers["frac_truncated"] = [cut.first, cut.last]
    if not facts:
        return None
    if run.online:
        mask = ", algo.mask_truncated=true (cut completions get no loss)" if run.setting("algo.mask_truncated") \
            is not None else ""
        change = (f"rollout.max_new_tokens={run.setting('rollout.max_new_tokens', 64)} is the cap{mask}; "
                  f"{penalty_change(run, budget)}; a learned reward: check it for a length bias (note 000 sec. 2.1)")
    else:
        change = f"{penalty_change(run, budget)}; or a length-normalised loss (algo=simpo)"
    return Finding("verbose", "; ".join(facts), change, numbers)


def repetitive(run: Run, limits: Limits, budget: float) -> Finding | None:
    facts, numbers = [], {}
    for key in ("distinct_2", "distinct_1"):
        c = start_and_end(run, key, evals_only=True)
        if c and c.first > 0 and 1 - c.last / c.first >= limits.distinct_drop:
            facts.append(f"{key.replace('_', '-')} {c.first:.3g} -> {c.last:.3g} ({c.last / c.first - 1:+.0%}, "
                         f"{c.where})")
            numbers[key] = [c.first, c.last]
    if not facts:
        return None
    repeat = start_and_end(run, "max_repeat", evals_only=True)
    if repeat:
        facts.append(f"max_repeat {repeat.first:.3g} -> {repeat.last:.3g}" + (
            " (no longer word loops: the samples of a prompt agree more)" if repeat.last <= repeat.first else ""))
    family = "; DPO family: objective=forward_kl or objective=js keeps more diversity (Wang et al. 2024)" \
        if run.setting("objective.divergence") is not None and not run.online and not run.reference_free else ""
    return Finding("repetitive", "; ".join(facts), penalty_change(run, budget) + family, numbers)


def collapsing(run: Run, limits: Limits, budget: float) -> Finding | None:
    facts, numbers = [], {}
    entropy = start_and_end(run, "entropy")
    if entropy and entropy.first > 0 and entropy.last <= (1 - limits.entropy_drop) * entropy.first:
        facts.append(f"entropy {entropy.first:.3g} -> {entropy.last:.3g} nats per token "
                     f"({entropy.last / entropy.first - 1:+.0%}, {entropy.where})")
        numbers["entropy"] = [entropy.first, entropy.last]
    distinct, g = series(run.evals, "distinct_2"), int(run.setting("eval.diversity_samples", 4))
    if distinct and g > 1 and distinct[-1][1] <= ONE_ANSWER / g:
        facts.append(f"distinct-2 {distinct[-1][1]:.3g} <= {ONE_ANSWER:g}/{g} at step {distinct[-1][0]:g}: one answer "
                     f"per prompt (of eval.diversity_samples={g})")
        numbers["distinct_2"] = distinct[-1][1]
    accuracy, kl = series(run.evals, "task_accuracy"), latest_kl(run)
    if accuracy and kl and accuracy[-1][1] <= ZERO_ACCURACY and kl[0] > budget:
        start = f" (from {accuracy[0][1]:.3f} at step {accuracy[0][0]:g})" if len(accuracy) > 1 else ""
        facts.append(f"task_accuracy {accuracy[-1][1]:.3f} at step {accuracy[-1][0]:g}{start} with KL {kl[0]:.3g} "
                     f"nats, past the budget of {budget:g}")
        numbers.update(task_accuracy=accuracy[-1][1], kl=kl[0])
    if not facts:
        return None
    lr = float(run.setting("trainer.lr", 2e-4))
    smaller = "" if run.reference_free else f"; or a smaller step: trainer.lr {lr:g} -> {lr / 4:g}"
    rows = run.setting("trainer.batch_size")
    if "task_accuracy" in numbers and _number(rows) and not run.online:  # KTO: 4 rows per step collapsed, 8 did not
        smaller += f"; or steadier steps: trainer.batch_size {rows:g} -> {2 * rows:g}"
    return Finding("collapsing", "; ".join(facts), penalty_change(run, budget) + smaller, numbers)


def narrowing(run: Run) -> list[str]:
    """The context of a diversity drop: the task accuracy rose with it (a one-answer task narrows on purpose)."""
    accuracy = start_and_end(run, "task_accuracy", evals_only=True)
    if accuracy and accuracy.last > accuracy.first:
        return [f"while task_accuracy rose {accuracy.first:.3f} -> {accuracy.last:.3f}: on a task with one right "
                "answer some narrowing is the point; act if you need varied samples"]
    return []


CHECKS = (not_moving, drifting, gold_vs_proxy, verbose, repetitive, collapsing)


def diagnose(run: Run, limits: Limits = Limits()) -> tuple[list[Finding], float, str]:
    """(findings, KL budget, where the budget came from) of a run; ``healthy`` when no check fires."""
    budget, source = budget_of(run, limits)
    if len(run.steps) < limits.min_steps:
        return [Finding("too_few_steps", f"{len(run.steps)} training steps logged, too few to judge (the doctor needs "
                        f"{limits.min_steps}; --min-steps)", "train longer (trainer.max_steps) and ask again",
                        {"steps": len(run.steps)})], budget, source
    findings = [f for check in CHECKS if (f := check(run, limits, budget)) is not None]
    diversity = [f for f in findings if f.verdict in ("repetitive", "collapsing")]
    if diversity and narrowing(run):  # said once, on the last of them
        diversity[-1].evidence += "; " + narrowing(run)[0]
    if findings:
        return findings, budget, source
    kl, entropy = latest_kl(run), start_and_end(run, "entropy")
    facts = [f"KL {kl[0]:.3g} nats per completion within the budget of {budget:g}" if kl else "no KL measured"]
    if entropy:
        facts.append(f"entropy {entropy.first:.3g} -> {entropy.last:.3g}")
    for key in ("distinct_2", "completion_length"):
        if c := start_and_end(run, key):
            facts.append(f"{key.replace('distinct_', 'distinct-')} {c.first:.3g} -> {c.last:.3g}")
    return [Finding("healthy", "; ".join(facts), "none", {"kl": kl[0] if kl else None})], budget, source


def render(run: Run, findings: list[Finding], budget: float, source: str) -> str:
    """The verdict list: a header, then per finding one line of evidence and one of the change to try."""
    head = (f"prefzoo diagnose {run.dir}: algo={run.algo}, {len(run.steps)} steps, beta={run.beta:g}, "
            f"KL budget {budget:g} nats ({source})")
    return "\n".join([head] + [f"{f.verdict.replace('_', ' ')}: {f.evidence}\n    -> {f.change}" for f in findings])


def bad_limit(args) -> str | None:
    """What is wrong with the command line's thresholds, or None: a KL budget or KL level <= 0 or not finite, fewer
    than 1 step, a growth ratio <= 0, a relative drop outside (0, 1]."""
    import math

    checks = [("--kl-budget", args.kl_budget, lambda v: v is None or (math.isfinite(v) and v > 0), "a number of nats > 0"),
              ("--min-steps", args.min_steps, lambda v: v >= 1, "an integer >= 1"),
              ("--not-moving-kl", args.not_moving_kl, lambda v: math.isfinite(v) and v > 0, "a number of nats > 0"),
              ("--length-ratio", args.length_ratio, lambda v: math.isfinite(v) and v > 0, "a ratio > 0"),
              ("--distinct-drop", args.distinct_drop, lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
              ("--entropy-drop", args.entropy_drop, lambda v: 0 < v <= 1, "a fraction in (0, 1]")]
    for flag, value, ok, what in checks:
        if not ok(value):
            return f"prefzoo diagnose {flag}={value:g}: give {what}."
    return None


def main(argv=None) -> int:
    """``prefzoo diagnose RUN_DIR [--json] [thresholds]``; a prefzoo error is one line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(prog="prefzoo diagnose", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="a run folder (metrics.jsonl, summary.json)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--kl-budget", type=float, help="KL budget, nats per completion (default: the run's "
                        f"objective.kl_budget or adaptive kl_target, else {DEFAULT_KL_BUDGET:g})")
    for name, what in (("min_steps", "fewest logged steps to judge"),
                       ("not_moving_kl", "KL (nats per completion) under which the policy is not moving"),
                       ("length_ratio", "completion-length growth that is verbose"),
                       ("distinct_drop", "relative distinct-n drop that is repetitive"),
                       ("entropy_drop", "relative entropy drop that is a collapse")):
        default = getattr(Limits(), name)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=type(default), default=default,
                            help=f"{what} (default {default:g})")
    args = parser.parse_args(argv)
    limits = replace(Limits(), **{k: v for k, v in vars(args).items() if k in Limits.__dataclass_fields__})
    bad = bad_limit(args)
    if bad is not None:
        print(f"prefzoo: error: {bad}", file=sys.stderr)
        return 2
    try:
        run = load_run(args.dir)
        findings, budget, source = diagnose(run, limits)
    except PrefzooError as err:
        print(f"prefzoo: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"run": str(run.dir), "algo": run.algo, "steps": len(run.steps), "beta": run.beta,
                          "kl_budget": budget, "kl_budget_source": source,
                          "findings": [asdict(f) for f in findings]}, indent=2))
    else:
        print(render(run, findings, budget, source))
    return 0
