"""Environment tokens carry no loss, no KL and no place in any per-token count, in every online plugin (issue 28).

A multi-turn trajectory's completion holds the policy's turns and, between them, the environment's tokens
(``token_mask`` True, ``completion_mask`` False). The policy below returns, at the environment's positions, log-probs
and entropies of our choosing: a plugin that let them into its loss, its KL (in the reward or as a loss), its entropy
or a per-token normaliser would move when they move. Each test perturbs them by +-7 nats and checks that nothing
does: the reduced loss, every gradient, every logged metric, to the last bit. A control test shows the perturbation is
seen where it should be: the same rows with the environment's tokens counted as the policy's (the "wrong" layout) give
another loss.

Tolerances: none, by design (tests/bounds.py, kind 1: exact where no rounding differs). Both runs do the same float
operations in the same order on the same values at the policy's tokens; the environment's enter only where a mask
replaces them by exact zeros (0 x a finite value, ``torch.where``, ``masked_fill``). So a correct plugin gives the same
bits, at any thread count, and any difference at all is a leak: the comparisons are ``==`` and ``torch.equal``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prefzoo.algos.cispo import CISPO, CISPOConfig
from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.algos.gspo import GSPO, GSPOConfig
from prefzoo.algos.ppo import PPO, PPOConfig
from prefzoo.algos.reinforce_pp import ReinforcePP, ReinforcePPConfig
from prefzoo.algos.rloo import RLOO, RLOOConfig
from prefzoo.training.step import accumulate_gradients
from prefzoo.types import ObjectiveSettings, PromptBatch, SamplingParams, SequenceBatch

T, V = 8, 6
#: completion layout of each row: P = the policy's token, E = the environment's, . = padding
LAYOUTS = ["PPEEEPP.", "PPPEEPPP", "PP......", "PEEPEEPP"]


class TurnPolicy:
    """Log-probs from a per-position logit table (a parameter); at the environment's positions (the "E" of
    :data:`LAYOUTS`, whatever the batch's masks say) it adds ``env_logp`` to the log-prob and ``env_entropy`` to the
    entropy -- values a correct plugin never reads."""

    def __init__(self, env_logp: float = 0.0, env_entropy: float = 0.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.nn.Parameter(torch.randn(T, V, generator=g))
        self.ref = torch.randn(T, V, generator=g)
        self.reference = object()
        self.value_table = torch.nn.Parameter(torch.randn(T, generator=g))
        self.value_model = None
        self.env_logp, self.env_entropy = env_logp, env_entropy

    def _lp(self, table, batch, temperature):
        lp = torch.log_softmax(table / temperature, -1)
        out = lp[None].expand(len(batch), T, V).gather(-1, batch.completion_ids[..., None])[..., 0]
        out = torch.where(self._env(batch), out + self.env_logp, out)  # what a wrong plugin would read
        return out.masked_fill(~batch.completion_tokens, 0.0)

    @staticmethod
    def _env(batch):
        """Where each row's environment tokens are: its layout's number travels as its (one-token) prompt id, so
        every micro-batch's rows still say it (the table's log-probs do not read the prompt)."""
        return torch.tensor([[c == "E" for c in LAYOUTS[int(k)]] for k in batch.prompt_ids[:, 0]])

    def logps(self, batch, temperature=1.0, with_entropy=False):
        ent = None
        if with_entropy:
            p = torch.softmax(self.logits.detach() / temperature, -1)
            ent = (-(p * p.log()).sum(-1))[None].expand(len(batch), -1).clone()
            ent = torch.where(self._env(batch), ent + self.env_entropy, ent).masked_fill(~batch.completion_tokens, 0.0)
        return self._lp(self.logits, batch, temperature), ent

    def ref_logps(self, batch, temperature=1.0):
        return self._lp(self.ref, batch, temperature).detach()

    def values(self, batch):
        """V of the state before each position (a trainable per-position table); at the environment's positions it
        adds ``env_logp`` too: PPO's GAE and value loss must not read them."""
        v = self.value_table[None].expand(len(batch), T)
        return torch.where(self._env(batch), v + self.env_logp, v).masked_fill(~batch.completion_tokens, 0.0)

    def logps_and_values(self, batch, temperature=1.0, with_entropy=False):
        return (*self.logps(batch, temperature, with_entropy), self.values(batch))

    def sample(self, prompts, n, params, layouts=LAYOUTS):
        b = prompts.prompt_ids.shape[0] * n
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, V, (b, T), generator=g)
        rows = [layouts[i % len(layouts)] for i in range(b)]
        policy = torch.tensor([[c == "P" for c in r] for r in rows])
        present = torch.tensor([[c != "." for c in r] for r in rows])
        layout = torch.tensor([[i % len(layouts)] for i in range(b)])
        return SequenceBatch(layout, prompts.prompt_mask.repeat_interleave(n, 0), ids.masked_fill(~present, 0), policy,
                             torch.arange(prompts.prompt_ids.shape[0]).repeat_interleave(n),
                             torch.zeros(b, dtype=torch.bool), token_mask=present)


PROMPTS = PromptBatch(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool), {})
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0, 0.75, 0.5])


def score(samples, prompts):
    return REWARDS[: len(samples)]


#: (plugin, config, objective): each online member with a KL term where it has one, so the KL is checked too
PLUGINS = {
    "grpo_kl_as_loss": (GRPO, GRPOConfig(), ObjectiveSettings(beta=0.1, kl_estimator="k3", kl_placement="as_loss")),
    "grpo_kl_in_reward": (GRPO, GRPOConfig(), ObjectiveSettings(beta=0.1, kl_estimator="k1", kl_placement="in_reward")),
    "grpo_dapo_two_epochs": (GRPO, GRPOConfig(loss_aggregation="dapo", epochs=2),
                             ObjectiveSettings(beta=0.05, kl_estimator="k2", kl_placement="as_loss")),
    "rloo": (RLOO, RLOOConfig(), ObjectiveSettings(beta=0.05)),
    "reinforce_pp": (ReinforcePP, ReinforcePPConfig(), ObjectiveSettings(beta=0.01)),
    "gspo": (GSPO, GSPOConfig(), ObjectiveSettings(beta=0.0)),
    "cispo": (CISPO, CISPOConfig(), ObjectiveSettings(beta=0.0)),
    "ppo": (PPO, PPOConfig(num_samples=4), ObjectiveSettings(beta=0.05)),  # GAE and the value loss over policy tokens
}


def step(name, env_logp, env_entropy, layouts=LAYOUTS):
    cls, cfg, objective = PLUGINS[name]
    algo = cls(dataclasses.replace(cfg), objective, SamplingParams(temperature=1.0))
    policy = TurnPolicy(env_logp, env_entropy)
    sample = policy.sample
    policy.sample = lambda prompts, n, params: sample(prompts, n, params, layouts)
    batch, rollout_metrics = algo.make_experience(policy, PROMPTS, score)
    metrics = accumulate_gradients(algo, policy, batch, micro_batch_size=3)
    grad = torch.cat([policy.logits.grad.flatten(),
                      policy.value_table.grad.flatten() if policy.value_table.grad is not None else torch.zeros(0)])
    return batch, {**rollout_metrics, **metrics}, grad


def finite(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and "per_second" not in k}


@pytest.mark.parametrize("name", list(PLUGINS))
def test_the_environments_tokens_move_nothing(name):
    """Perturb the environment's log-probs and entropies by +7 and by -7 nats: the loss, the gradient of the logit
    table, the KL and entropy metrics, the advantages and every per-token count are those of the unperturbed run."""
    batch0, m0, g0 = step(name, 0.0, 0.0)
    assert batch0.loss_mask.sum() == sum(r.count("P") for r in LAYOUTS) * 2  # the policy's tokens, both prompts
    assert not bool((batch0.loss_mask & ~batch0.completion_mask).any())
    for shift in (7.0, -7.0):
        batch, m, g = step(name, shift, shift)
        assert finite(m) == finite(m0), name
        assert torch.equal(g, g0), name
        assert torch.equal(batch.advantages, batch0.advantages)
        for field in ("old_logps", "ref_logps"):
            a, b = getattr(batch, field), getattr(batch0, field)
            if a is not None:
                assert torch.equal(a[batch.completion_mask], b[batch.completion_mask])


def test_counting_the_environments_tokens_as_the_policys_changes_the_loss():
    """The control: the same rows with every present token marked the policy's ("E" read as "P") give another
    gradient under the perturbation -- the perturbation is visible exactly when the mask lets it in."""
    wrong = [r.replace("E", "P") for r in LAYOUTS]
    _, _, g0 = step("grpo_kl_as_loss", 0.0, 0.0, wrong)
    _, _, g1 = step("grpo_kl_as_loss", 7.0, 7.0, wrong)
    assert not torch.equal(g0, g1)
