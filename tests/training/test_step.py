"""One optimisation step for every trainer (prefzoo.training.step.optimisation_step).

The Trainer (:meth:`prefzoo.training.loop.Trainer.train_step`) and the tabular bed's driver
(:func:`prefzoo.lab.tabular.train`) must run the very same epochs x mini-batches x micro-batches block: both
bind the one function, each calls it once per training step, and on the same policy, batch, optimizer and
mini-batch orders they leave bit-identical parameters.
"""

from types import SimpleNamespace

import pytest
import torch

import prefzoo.training.step as step
from prefzoo.algos import get_algorithm
from prefzoo.types import ObjectiveSettings
from prefzoo.lab.tabular import (BED_SAMPLING, PairSource, PromptSource, TableScorer, TabularBandit, TabularPolicy, TrainSettings,
                                 preference_pairs, train)

REF = torch.tensor([[0.0, 1.0, -1.0, 0.5], [2.0, 0.0, 0.0, -2.0]])
REWARDS = torch.tensor([[0.0, 1.0, 0.5, 0.2], [0.3, 0.0, 1.0, 0.6]])
LR = 0.05
MICRO = 3  # rows per micro-batch: 16 rollouts in 2 mini-batches of 8 = micro-batches of 3, 3, 2


@pytest.fixture(autouse=True)
def keep_global_rng():
    """The Trainer draws mini-batch orders from torch's global generator; leave it as it was."""
    state = torch.get_rng_state()
    yield
    torch.set_rng_state(state)


def _grpo(num_minibatches: int = 2):
    cls = get_algorithm("grpo")
    return cls(cls.config_class(num_samples=4, epochs=2, num_minibatches=num_minibatches),
               ObjectiveSettings(beta=0.1, kl_estimator="k1", kl_placement="in_reward"), BED_SAMPLING)


def _bare_trainer(algo, policy, align_orders: bool = True):
    """A Trainer without __init__ (no model, tokenizer or data): the tabular policy, Adam at a constant rate (the
    bed's ``optimizer="adam", lr_schedule="constant"``), one process, no clipping (``max_grad_norm=0``), and an
    experience source whose ``next_batch`` samples the step's experience with the policy's generator as the bed does. The Trainer
    draws mini-batch orders from torch's global generator, the bed from the policy's; with ``align_orders`` the
    global generator is put in the policy generator's state after sampling, so both draw the same orders."""
    from prefzoo.training.distributed import DataParallel
    from prefzoo.training.loop import Trainer

    tr = object.__new__(Trainer)
    tr.algo, tr.policy, tr.dp, tr.train_module, tr.scorer = algo, policy, DataParallel(), None, None
    tr.remote = None  # backend=local (backend=tinker: the server session, prefzoo.tinker.backend)
    tr.declaration = algo.declaration
    tr.params = [p for p in policy.parameters() if p.requires_grad]
    tr.optimizer = torch.optim.Adam(tr.params, lr=LR, betas=(0.9, 0.999))
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lambda s: 1.0)
    tr.cfg = SimpleNamespace(trainer=SimpleNamespace(micro_batch_size=MICRO, max_grad_norm=0.0, kl_metric_every=0))
    tr.step, tr.model = 0, None

    def next_batch(step, context):
        out = algo.make_experience(policy, PromptSource(2, repeats=4).next(), TableScorer(REWARDS), step=context)
        if align_orders:
            torch.set_rng_state(policy.generator.get_state())
        return out
    tr.source = SimpleNamespace(next_batch=next_batch, after_update=lambda step, model: None)
    return tr


def _bed_step(policy, algo):
    return train(algo, policy, PromptSource(2, repeats=4),
                 TrainSettings(steps=1, lr=LR, lr_schedule="constant", micro_batch_size=MICRO),
                 scorer=TableScorer(REWARDS))[0]


def test_the_trainer_and_the_bed_bind_and_call_the_one_optimisation_step(monkeypatch):
    """Both modules hold the very function of prefzoo.training.step, and one training step of each calls it
    exactly once (with the step's whole batch: 2 prompts x 4 repeats x 4 samples = 32 rows)."""
    import prefzoo.lab.tabular as tabular
    import prefzoo.training.loop as loop

    assert loop.optimisation_step is step.optimisation_step
    assert tabular.optimisation_step is step.optimisation_step
    calls = []

    def spy(algo, policy, batch, *args, **kwargs):
        calls.append(len(batch))
        return step.optimisation_step(algo, policy, batch, *args, **kwargs)
    monkeypatch.setattr(loop, "optimisation_step", spy)
    monkeypatch.setattr(tabular, "optimisation_step", spy)
    _bare_trainer(_grpo(), TabularPolicy(REF, seed=3)).train_step()
    _bed_step(TabularPolicy(REF, seed=3), _grpo())
    assert calls == [32, 32]


def test_the_trainer_and_the_bed_leave_the_same_parameters():
    """GRPO, 2 passes x 2 mini-batches x micro-batches of 3, from the same seed: the bed's ``train`` step and the
    Trainer's ``train_step`` give bit-identical logits (the Trainer clips at +inf, which multiplies by 1.0), the
    same loss and learning rate. Control: with the Trainer's orders left to the global generator (other orders)
    the logits differ, so the equality is not vacuous."""
    bed_policy, trainer_policy = TabularPolicy(REF, seed=3), TabularPolicy(REF, seed=3)
    bed = _bed_step(bed_policy, _grpo())
    ran = _bare_trainer(_grpo(), trainer_policy).train_step()
    assert not torch.equal(bed_policy.logits, TabularPolicy(REF).logits)  # it trained
    assert torch.equal(trainer_policy.logits, bed_policy.logits)
    assert ran["loss"] == bed["loss"] and ran["lr"] == bed["lr"] == LR and ran["beta"] == bed["beta"]
    assert "grad_norm" in ran and "grad_norm" not in bed  # the Trainer measures it; the bed (no clipping) does not
    torch.manual_seed(12345)
    other = TabularPolicy(REF, seed=3)
    _bare_trainer(_grpo(), other, align_orders=False).train_step()
    assert not torch.equal(other.logits, bed_policy.logits)


@pytest.mark.numerics
def test_one_pass_one_minibatch_sgd_is_minus_lr_times_the_batch_gradient():
    """DPO on 12 preference pairs, SGD at lr 0.1, micro-batches of 5: the step moves the logits by exactly
    -lr x the gradient of the whole batch's mean DPO loss, computed here from the table by hand
    (-log sigmoid(beta ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected)))), and reports it.

    The bounds (kind 2 of tests/bounds.py): both sides are float32. Each gradient element is a sum over the 12 pairs
    of c_i (e_y - p) terms (c_i = dl_i/dm_i, e_y - p the log-softmax's gradient of a chosen or rejected response),
    added in micro-batches of 5, 5, 2 by the step and in one mean here, each term made by <= 12 float32 operations:
    two computations differ by at most 2 gamma_24 A, A = sum_i |c_i| (|e_chosen - p| + |e_rejected - p|) / 12
    (the terms before they cancel: a response never drawn gets +c p and -c p from every pair, 0 in exact arithmetic,
    1.3e-9 here). The update rounds once in SGD and twice here (0.1 g, then the subtraction): 3 u32 (|theta_new| +
    0.1 |g|) more. The loss: 12 terms of <= 6 roundings, 2 sum_bound(18, mean |l_i|); the gradient norm:
    2 gamma_24 ||A|| + 2 gamma_10 ||g|| (8 squares, a sqrt). Measured: 4.7e-10 on the logits, 0 on loss and norm
    (1 and 2 threads), against 1.2e-8 to 3.9e-7, 1.4e-6 and 9.2e-7 (the bounds were a round 1e-6 each)."""
    from tests.bounds import U32, gamma, sum_bound

    bandit = TabularBandit(REF, REWARDS)
    pairs = preference_pairs(bandit, 6, torch.Generator().manual_seed(0))
    cls = get_algorithm("dpo")
    algo = cls(cls.config_class(), ObjectiveSettings(beta=0.5))
    policy = TabularPolicy(REF)
    params = [policy.logits]
    opt = torch.optim.SGD(params, lr=0.1)
    start = policy.logits.detach().clone()

    theta = start.clone().requires_grad_(True)
    rows = pairs.chosen.prompt_ids[:, -1]
    logp, logp_ref = torch.log_softmax(theta, -1), torch.log_softmax(REF, -1)
    margin = lambda ids: (logp - logp_ref)[rows, ids[:, 0]]  # noqa: E731
    m = margin(pairs.chosen.completion_ids) - margin(pairs.rejected.completion_ids)
    per_pair = -torch.nn.functional.logsigmoid(0.5 * m)
    (c,) = torch.autograd.grad(per_pair.sum(), m, retain_graph=True)

    def side(i, ids):  # |e_y - p| on the pair's row: the gradient of log pi(y | x) before it meets the other side
        return torch.autograd.grad(logp[rows[i], ids[i, 0]], theta, retain_graph=True)[0].abs()

    terms = sum(float(c[i].abs()) * (side(i, pairs.chosen.completion_ids) + side(i, pairs.rejected.completion_ids))
                for i in range(len(m))) / len(m)  # A
    loss = per_pair.mean()
    loss.backward()

    out = step.mean_metrics(step.optimisation_step(algo, policy, pairs, opt, None, params, 5,
                                                   max_grad_norm=float("inf")))
    want = start - 0.1 * theta.grad
    bound = 0.1 * 2 * gamma(24) * terms + 3 * U32 * (want.abs() + 0.1 * theta.grad.abs())
    assert bool(((policy.logits.detach() - want).abs() <= bound).all())
    assert abs(out["loss"] - float(loss.detach())) <= 2 * sum_bound(18, float(per_pair.detach().abs().mean()))
    assert abs(out["grad_norm"] - float(theta.grad.norm())) <= (2 * gamma(24) * float(terms.norm())
                                                               + 2 * gamma(10) * float(theta.grad.norm()))
    assert out["lr"] == 0.1


def test_orders_are_drawn_once_per_pass_over_the_global_rows():
    """``permutation(n)`` is asked once per pass, with the number of GLOBAL rows, only when there is more than one
    mini-batch; each mini-batch holds its slice of the order (here reversed rows: 16 rows, 2 mini-batches of 8)."""
    algo = _grpo()
    policy = TabularPolicy(REF, seed=0)
    batch, _ = algo.make_experience(policy, PromptSource(2, repeats=2).next(), TableScorer(REWARDS))
    asked, seen = [], []
    original_loss = algo.loss

    def loss(pol, mb, step):
        seen.append(mb.completion_ids[:, 0].tolist())
        return original_loss(pol, mb, step)
    algo.loss = loss
    params = [policy.logits]
    opt = torch.optim.SGD(params, lr=0.0)

    def reverse(n):
        asked.append(n)
        return list(range(n))[::-1]
    step.optimisation_step(algo, policy, batch, opt, None, params, None, permutation=reverse)
    ids = batch.completion_ids[:, 0].tolist()
    assert asked == [16, 16]
    assert seen == [ids[::-1][:8], ids[::-1][8:]] * 2
    algo = _grpo(num_minibatches=1)
    asked.clear()
    step.optimisation_step(algo, policy, batch, opt, None, params, None, permutation=reverse)
    assert asked == []


def test_one_minibatch_trains_on_the_batch_itself_without_copying_its_rows(monkeypatch):
    """With one mini-batch every pass is the whole batch in order: no row-list copy of it per pass (on the
    conformance table's 320,000 DPO pairs such a copy doubled the run time). Measured before the fix: one
    ``select`` with a list of all 16 rows per pass (2 here); after: only the micro-batch slices."""
    algo = _grpo(num_minibatches=1)
    policy = TabularPolicy(REF, seed=0)
    batch, _ = algo.make_experience(policy, PromptSource(2, repeats=2).next(), TableScorer(REWARDS))
    picked = []
    original = type(batch).select

    def select(self, index):
        picked.append(index)
        return original(self, index)
    monkeypatch.setattr(type(batch), "select", select)
    step.optimisation_step(algo, policy, batch, torch.optim.SGD([policy.logits], lr=0.0), None, [policy.logits], 8)
    assert picked == [slice(0, 8), slice(8, 16)] * 2
