"""Evaluation shared by every algorithm, run before and after training on held-out data.

Metrics (keys of the returned dict):

* ``task_reward`` (+ ``_se``): mean reward of the greedy completion of each held-out prompt, under the
  run's reward (``reward.*``; with a gold reward configured this is the PROXY); ``task_accuracy``
  (+ ``_se``): exact-match accuracy when the task has answers.
* sampled metrics, from ``diversity_samples`` completions at temperature 1 for ``diversity_prompts``
  prompts: ``sample_reward`` (+ ``_se``, the run's reward), ``kl_k1`` and ``kl_k3`` (sequence KL(pi || pi_ref)
  estimates, nats, when a reference is available; ``kl_method`` says how it was obtained), ``entropy`` (mean
  per-token entropy, nats), ``distinct_1`` / ``distinct_2`` (across samples of the same prompt),
  ``completion_length`` (tokens), ``max_repeat``.
* gold reward (``eval.gold_reward.functions``, e.g. the verifier a reward model was trained to imitate;
  Gao et al. 2023): ``gold_task_reward`` (+ ``_se``) on the greedy completions and ``gold_sample_reward``
  (+ ``_se``) on the sampled ones, next to the run's (proxy) ``task_reward`` / ``sample_reward``.
* ``pass_at_k``: fraction of problems with at least one correct sample among k (Chen et al. 2021).
* ``preference_accuracy`` (+ ``_se``): held-out pairs whose implicit reward ranks chosen above rejected
  (a tie counts one half: before DPO training every pair ties, which is chance, 0.5).

With ``eval.sampler_logps`` the policy's log-probs and entropies of the samples come from the sampler itself when it
is the policy up to float32 rounding (the hf engine on the model or its merged copy in the model's dtype:
``SamplingParams.report_entropy``), which saves a pass of the policy over every sample (measured: a point of the
over-optimisation design 123 s -> 78 s of sampled metrics with the reward model's fast path, bench/bench_eval.py).
The price is a bias: the decode loop's incremental attention is not the full pass's arithmetic, and on SmolLM2 its
log-probs are higher by 8.3e-6 nats per token on average (mean |difference| 8.7e-6, max 3.6e-5, entropies within
4.3e-5: measured at the untrained policy, 64 samples), so a KL estimate gains ~3e-4 nats per 37-token completion: at
the reference d = sqrt(KL) reads 0.017 instead of 0. Negligible where KL is large (the over-optimisation recipes
turn it on: at d = 0.1 the error on d is 0.0015), not where it is small (a policy that hardly moved), so it is off by
default; otherwise (off, vLLM, a sampler in another dtype, multi-turn episodes) a pass of the policy over the samples.

Policies without per-token log-probs. A policy sets ``tractable_logps`` (part of the policy interface:
True for :class:`~prefzoo.models.policy.CausalLMPolicy`; False for best-of-n (best-of-n:
whose sequence distribution has no token-level factorisation to evaluate): ``entropy`` is then left out, and
its KL to the reference comes from the policy's ``analytic_kl`` (nats per sequence, e.g. log n - (n-1)/n)
under the same keys ``kl_k1`` / ``kl_k3`` (standard error 0), with ``kl_method = "analytic"``; otherwise
``kl_method = "sampled"`` (k1 / k3 Monte-Carlo estimates on the samples).

A reward function that cannot score the held-out prompts (e.g. ``correctness`` on a preference file
without an ``answer`` column) is reported once as a warning and its reward metrics are left out; the
other metrics are still computed.

Standard errors are binomial/normal: sqrt(var / n).
"""

from __future__ import annotations

import logging
import math

import torch
from tqdm.auto import tqdm

from prefzoo.types import SamplingParams, episode_metrics
from prefzoo.data.preference import collate_preferences
from prefzoo.errors import RewardError
from prefzoo.evaluation.diversity import grouped_distinct_n, max_repeat_run
from prefzoo.objective import masked_mean, sequence_kl

from prefzoo.rewards.protocol import COMPLETION_IDS, COMPLETION_MESSAGES, ENVIRONMENTS, completion_id_lists

log = logging.getLogger(__name__)


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(1, n - 1)
    return mean, math.sqrt(var / n)


class Evaluator:
    """Held-out evaluation of a :class:`~prefzoo.models.policy.CausalLMPolicy`.

    Args:
        policy: the policy (its reference, if any, is used for the KL estimates).
        reward_fn: the task's reward ``(prompts, completions, **columns) -> list[float]``.
        prompts: held-out prompts (:class:`~prefzoo.data.prompts.PromptSet`), or None.
        cfg: the ``eval`` config.
        correctness_fn: exact-match function for ``task_accuracy`` when the prompts have answers, or None.
        preference_examples: held-out preference pairs, or None.
        implicit_rewards: ``(policy, pair batch) -> (chosen rewards (B,), rejected rewards (B,))``, the plugin's
            held-out ranking (its declared capability ``implicit_rewards``), or None: no preference accuracy.
        num_samples: k for pass@k (the online algorithms' group size), or 0 to skip.
        gold_reward_fn: a second reward, the gold standard the run's (proxy) reward stands in for, or None.
    """

    def __init__(self, policy, reward_fn, prompts, cfg, *, correctness_fn=None, preference_examples=None,
                 implicit_rewards=None, num_samples: int = 0, seed: int = 0, progress: bool = True, gold_reward_fn=None):
        self.policy, self.reward_fn, self.cfg = policy, reward_fn, cfg
        self.prompts = prompts.subset(min(cfg.num_problems, len(prompts))) if prompts is not None else None
        self.correctness_fn = correctness_fn
        self.gold_reward_fn = gold_reward_fn
        self._unusable: set[str] = set()  # reward functions that could not score these prompts (warned once)
        self.preference_examples = preference_examples
        self.implicit_rewards = implicit_rewards
        self.num_samples, self.seed, self.progress = num_samples, seed, progress

    def _decode(self, samples) -> list[str]:
        ids = samples.completion_ids.masked_fill(~samples.completion_mask, self.policy.pad_id)
        return self.policy.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _generate(self, prompts, indices, k, params, desc: str):
        """(texts, prompt texts, columns, samples) for k samples of each prompt in ``indices``."""
        out = []
        step = max(1, self.cfg.batch_size // k)
        for start in tqdm(range(0, len(indices), step), desc=f"eval: {desc}", disable=not self.progress, leave=False):
            idx = indices[start:start + step]
            batch = prompts.batch(idx, self.policy.pad_id).to(self.policy.device)
            samples = self.policy.sample(batch, k, params)
            cols = {c: [v[i] for i in range(len(idx)) for _ in range(k)] for c, v in batch.columns.items()}
            cols[COMPLETION_IDS] = completion_id_lists(samples)  # TRL's completion_ids= (CombinedReward pops it)
            texts = self._decode(samples)
            if samples.episodes is not None:  # multi-turn: the final answers, and the conversations for TRL's rewards
                texts = [e.answer for e in samples.episodes]
                cols[COMPLETION_MESSAGES] = [e.messages for e in samples.episodes]
                cols[ENVIRONMENTS] = [e.environment for e in samples.episodes]
            out.append((texts, cols.pop("prompt_text"), cols, samples))
        return out

    def _score(self, fn, prompt_texts, texts, cols) -> list[float]:
        return [float(r) for r in fn(prompt_texts, texts, **cols)]

    def _try_score(self, name: str, fn, prompt_texts, texts, cols) -> list[float] | None:
        """``fn``'s scores, or None (with one warning) when it cannot score these prompts."""
        if fn is None or name in self._unusable:
            return None
        try:
            return self._score(fn, prompt_texts, texts, cols)
        except RewardError as err:
            self._unusable.add(name)
            log.warning("evaluation: the %s cannot score the held-out prompts, its metrics are left out: %s", name, err)
            return None

    @torch.no_grad()
    def task_metrics(self) -> dict:
        params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, greedy=True)
        rewards, gold, correct, examples, episodes = [], [], [], [], []
        n = 0
        for texts, prompt_texts, cols, samples in self._generate(self.prompts, list(range(len(self.prompts))), 1,
                                                                 params, "greedy answers"):
            n += len(texts)
            scores = self._try_score("reward", self.reward_fn, prompt_texts, texts, cols) or []
            if scores and samples.episodes is not None:  # an environment's own reward adds, as in training
                scores = [r + (e.env_reward or 0.0) for r, e in zip(scores, samples.episodes)]
            episodes += samples.episodes or []
            rewards += scores
            gold += self._try_score("gold reward", self.gold_reward_fn, prompt_texts, texts, cols) or []
            correct += self._try_score("correctness", self.correctness_fn, prompt_texts, texts, cols) or []
            examples += [{"prompt": p[-200:], "completion": t} for p, t in zip(prompt_texts, texts)][: 3 - len(examples)]
        out = {"n_problems": n}
        if len(rewards) == n:
            out["task_reward"], out["task_reward_se"] = _mean_se(rewards)
        if gold and len(gold) == n:
            out["gold_task_reward"], out["gold_task_reward_se"] = _mean_se(gold)
        if correct and len(correct) == n:
            out["task_accuracy"], out["task_accuracy_se"] = _mean_se(correct)
        if episodes:  # greedy episodes: turns, tool calls, failed calls per episode, share cut by the budget
            out.update({f"episode_{k}": v for k, v in episode_metrics(episodes).items()})
        out["greedy_examples"] = examples
        return out

    @torch.no_grad()
    def sampled_metrics(self) -> dict:
        k, n = self.cfg.diversity_samples, min(self.cfg.diversity_prompts, len(self.prompts))
        params = SamplingParams(temperature=1.0, max_new_tokens=self.cfg.max_new_tokens,
                                report_entropy=self.cfg.sampler_logps)
        texts_all, rewards, gold, kl1, kl3, ent, lengths = [], [], [], [], [], [], []
        tractable = self.policy.tractable_logps
        has_ref = tractable and self.policy.reference is not None
        for texts, prompt_texts, cols, samples in self._generate(self.prompts, list(range(n)), k, params, "samples"):
            texts_all += texts
            rewards += self._try_score("reward", self.reward_fn, prompt_texts, texts, cols) or []
            gold += self._try_score("gold reward", self.gold_reward_fn, prompt_texts, texts, cols) or []
            mask = samples.completion_mask
            lengths += mask.sum(-1).tolist()
            if not tractable:
                continue
            if samples.sample_entropy is not None and samples.sample_logps is not None:  # the sampler is the policy
                logps, entropy = samples.sample_logps, samples.sample_entropy
            else:
                logps, entropy = self.policy.logps(samples, with_entropy=True)
            if entropy is not None:  # (None: a policy without the distribution, backend=tinker: no entropy metric)
                ent += masked_mean(entropy, mask, dim=-1).tolist()
            if has_ref:
                ref_logps = self.policy.ref_logps(samples)
                kl1 += sequence_kl(logps, ref_logps, mask, "k1").tolist()
                kl3 += sequence_kl(logps, ref_logps, mask, "k3").tolist()
        out = {"distinct_1": grouped_distinct_n(texts_all, k, 1), "distinct_2": grouped_distinct_n(texts_all, k, 2),
               "completion_length": _mean_se(lengths)[0],
               "max_repeat": _mean_se([float(max_repeat_run(t)) for t in texts_all])[0],
               "sample_examples": texts_all[:: k][:3]}
        if len(rewards) == len(texts_all):
            out["sample_reward"], out["sample_reward_se"] = _mean_se(rewards)
        if gold and len(gold) == len(texts_all):
            out["gold_sample_reward"], out["gold_sample_reward_se"] = _mean_se(gold)
        if ent:
            out["entropy"] = _mean_se(ent)[0]
        analytic = self.policy.analytic_kl
        if analytic is not None:
            out.update({"kl_k1": float(analytic), "kl_k1_se": 0.0, "kl_k3": float(analytic), "kl_k3_se": 0.0,
                        "kl_method": "analytic"})
        elif has_ref:
            out["kl_k1"], out["kl_k1_se"] = _mean_se(kl1)
            out["kl_k3"], out["kl_k3_se"] = _mean_se(kl3)
            out["kl_method"] = "sampled"
        return out

    @torch.no_grad()
    def pass_at_k(self) -> dict:
        k = self.num_samples
        n = min(self.cfg.pass_k_problems, len(self.prompts))
        params = SamplingParams(temperature=1.0, max_new_tokens=self.cfg.max_new_tokens)
        solved = []
        for texts, prompt_texts, cols, _ in self._generate(self.prompts, list(range(n)), k, params, f"pass@{k}"):
            c = self._score(self.correctness_fn, prompt_texts, texts, cols)
            solved += [float(any(x > 0 for x in c[i:i + k])) for i in range(0, len(c), k)]
        mean, se = _mean_se(solved)
        return {f"pass_at_{k}": mean, f"pass_at_{k}_se": se}

    @torch.no_grad()
    def preference_metrics(self) -> dict:
        wins = []
        ex = self.preference_examples
        for start in range(0, len(ex), self.cfg.batch_size // 2 or 1):
            idx = list(range(start, min(start + (self.cfg.batch_size // 2 or 1), len(ex))))
            batch = collate_preferences([ex[i] for i in idx], idx, self.policy.pad_id).to(self.policy.device)
            chosen, rejected = self.implicit_rewards(self.policy, batch)
            wins += ((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).tolist()  # a tie is a coin flip
        mean, se = _mean_se(wins)
        return {"preference_accuracy": mean, "preference_accuracy_se": se, "n_pairs": len(wins)}

    def policy_metrics(self) -> dict:
        """The metrics of the policy's own completions (greedy answers, samples, pass@k): everything but the
        preference accuracy. Seeded (``seed``), so the same policy gives the same samples before and after
        training; this is the part :mod:`prefzoo.training.baseline` reuses for the starting policy."""
        gen = torch.Generator(device=self.policy.device).manual_seed(self.seed)
        with self.policy.seeded(gen):  # the same samples before and after training
            out = {}
            if self.prompts is not None and len(self.prompts):
                out.update(self.task_metrics())
                out.update(self.sampled_metrics())
                if self.num_samples > 1 and self.correctness_fn is not None and "correctness" not in self._unusable:
                    out.update(self.pass_at_k())
            return out

    def pair_metrics(self) -> dict:
        """The held-out preference accuracy (the plugin's implicit rewards on held-out pairs), or {} without them."""
        if self.preference_examples and self.implicit_rewards is not None:
            return self.preference_metrics()
        return {}

    def run(self) -> dict:
        """All metrics that apply; keys as in the module docstring."""
        return {**self.policy_metrics(), **self.pair_metrics()}
