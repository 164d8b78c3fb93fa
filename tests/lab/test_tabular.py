"""Tests for prefzoo.lab.tabular: the tabular policy behind the Policy protocol, the data it produces, and the
driver that runs plugins on it through the shared optimisation step.

Expected values are written out independently (softmax, entropy, Bradley-Terry probabilities by hand).
"""

import math
from pathlib import Path

import pytest
import torch

from prefzoo.algos import get_algorithm
from prefzoo.types import ObjectiveSettings, Policy, PromptBatch, SamplingParams, SequenceBatch
from prefzoo.lab.tabular import (PairSource, PromptSource, TableScorer, TabularBandit, TabularError, TabularPolicy,
                             TrainSettings, kl_divergence, preference_pairs, prompt_batch, total_variation, train)
from tests.models.helpers import one_thread_fixture

REF = torch.tensor([[0.0, 1.0, -1.0, 0.5], [2.0, 0.0, 0.0, -2.0]])
REWARDS = torch.tensor([[0.0, 1.0, 0.5, 0.2], [0.3, 0.0, 1.0, 0.6]])


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread is fastest (and immune to a busy machine)."""
    yield from one_thread_fixture()


def _batch(rows, ids):
    rows, ids = torch.tensor(rows), torch.tensor(ids)
    ones = torch.ones(len(rows), 1, dtype=torch.bool)
    return SequenceBatch(rows[:, None], ones, ids[:, None], ones.clone())


def test_policy_protocol_and_attributes():
    policy = TabularPolicy(REF)
    assert isinstance(policy, Policy)
    assert policy.reference is not None and isinstance(policy.generator, torch.Generator)
    assert TabularPolicy(REF, with_reference=False).reference is None


def test_logps_are_log_softmax_of_the_table_with_temperature_and_entropy():
    """log pi(y|x) = logits[x, y]/T - log sum_k exp(logits[x, k]/T); entropy -sum p log p, by hand in float64.

    The bounds (kind 2 of tests/bounds.py: the table's float32 arithmetic against float64). A float32 log-softmax over
    K = 4 logits rounds z = logits / T, z - max z (|.| <= 2 max|z|), exp, a sum of K terms, the log and the final
    difference: |d log p_v| <= gamma_{K+6} (2 max|z| + |log p_v|). The entropy -sum_v p_v log p_v moves by
    sum_v p_v (1 + |log p_v|) |d log p_v| plus its own sum, gamma_K H. ~6e-6 and ~1e-5 here; measured (1 and 2
    threads) at most 3.0e-7 and 1.4e-7 (the bound was a round 1e-5 against a float32 hand value, measured 4.8e-7)."""
    from tests.bounds import gamma

    logits = torch.tensor([[0.3, -1.2, 2.0, 0.0], [1.0, 1.0, -0.5, 0.25]])
    policy = TabularPolicy(REF, init_logits=logits)
    batch = _batch([0, 1, 1, 0], [2, 3, 0, 1])
    k = logits.shape[1]
    for temperature in (1.0, 0.7):
        logps, entropy = policy.logps(batch, temperature, with_entropy=True)
        assert logps.shape == (4, 1) and logps.dtype == torch.float32 and logps.requires_grad
        for i, (x, y) in enumerate([(0, 2), (1, 3), (1, 0), (0, 1)]):
            z = logits[x].double() / temperature
            log_p = z - math.log(float(torch.exp(z).sum()))
            d_log_p = gamma(k + 6) * (2 * z.abs().max() + log_p.abs())
            assert abs(float(logps[i, 0].detach()) - float(log_p[y])) <= float(d_log_p[y])
            p = log_p.exp()
            h = float(-(p * log_p).sum())
            d_h = float((p * (1 + log_p.abs()) * d_log_p).sum()) + gamma(k) * h
            assert abs(float(entropy[i, 0]) - h) <= d_h
    ref = policy.ref_logps(batch)
    assert float(ref[0, 0]) == float(torch.log_softmax(REF[0], -1)[2])  # the same float32 log-softmax: bit for bit
    assert not ref.requires_grad


def test_masked_positions_are_zero_and_get_no_gradient():
    policy = TabularPolicy(REF)
    batch = _batch([0, 1], [1, 2])
    batch.completion_mask[1, 0] = False
    logps, _ = policy.logps(batch)
    assert float(logps[1, 0].detach()) == 0.0
    logps.sum().backward()
    assert float(policy.logits.grad[1].abs().sum()) == 0.0 and float(policy.logits.grad[0].abs().sum()) > 0


def test_bad_batches_and_missing_reference_raise_typed_errors():
    policy = TabularPolicy(REF, with_reference=False)
    with pytest.raises(TabularError, match="no reference"):
        policy.ref_logps(_batch([0], [1]))
    with pytest.raises(TabularError, match="prompt index out of range"):
        policy.logps(_batch([5], [1]))
    with pytest.raises(TabularError, match="response index out of range"):
        policy.logps(_batch([0], [9]))
    ones = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(TabularError, match="single-token"):
        zeros = torch.zeros(1, 2, dtype=torch.long)
        policy.logps(SequenceBatch(zeros[:, :1], ones[:, :1], zeros, ones))
    with pytest.raises(TabularError, match="value head"):
        policy.values(_batch([0], [1]))


def test_sample_is_grouped_reproducible_and_follows_the_policy():
    """Rows [i*n, (i+1)*n) answer prompt i; frequencies of 100k draws are within 0.01 TV of softmax
    (expected TV of the empirical distribution is ~ sqrt(K / (2 pi N)) ~ 0.002).

    Tolerances of this file's sampling tests (kind 4 of tests/bounds.py; every seed is fixed, so each test is
    deterministic, and the probability is that of another seed failing). By Cauchy-Schwarz sum_k |f_k - p_k| <=
    sqrt(X / N) with X = N sum_k (f_k - p_k)^2 / p_k, Pearson's statistic, chi-squared with K - 1 = 3 degrees of
    freedom: TV >= 0.01 needs X >= 0.02^2 N = 20 at N = 50,000 draws per prompt (P = 1.7e-4 per prompt), X >= 16 at
    the 40,000 of the temperature test (P = 1.1e-3); the 6 unordered pairs of 100,000 per prompt in
    test_preference_pairs_follow_pi_ref_and_bradley_terry need X >= 40 of 5 degrees of freedom (P = 1.5e-7), and
    its win rates, over >= 41,000 pairs each (s.e. <= 0.0025), are within 0.02 = 8 s.e. (P = 1e-15)."""
    prompts = prompt_batch(torch.tensor([1, 0]))
    params = SamplingParams(temperature=1.0, max_new_tokens=1)
    a = TabularPolicy(REF, seed=3).sample(prompts, 50_000, params)
    b = TabularPolicy(REF, seed=3).sample(prompts, 50_000, params)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert a.completion_ids.shape == (100_000, 1) and bool(a.completion_mask.all())
    assert torch.equal(a.prompt_ids[:50_000, 0], torch.ones(50_000, dtype=torch.long))
    assert torch.equal(a.prompt_index, torch.tensor([0, 1]).repeat_interleave(50_000))
    assert not bool(a.truncated.any())
    for block, x in ((slice(0, 50_000), 1), (slice(50_000, None), 0)):
        freq = torch.bincount(a.completion_ids[block, 0], minlength=4).double() / 50_000
        assert float(total_variation(freq, torch.softmax(REF[x].double(), -1))) < 0.01


def test_sample_temperature_greedy_and_top_p():
    policy = TabularPolicy(REF, seed=0)
    prompts = prompt_batch(torch.tensor([0]))
    greedy = policy.sample(prompts, 5, SamplingParams(greedy=True))
    assert greedy.completion_ids[:, 0].tolist() == [1] * 5
    hot = policy.sample(prompts, 40_000, SamplingParams(temperature=2.0))
    freq = torch.bincount(hot.completion_ids[:, 0], minlength=4).double() / 40_000
    assert float(total_variation(freq, torch.softmax(REF[0].double() / 2, -1))) < 0.01
    # pi(.|0) = softmax(0, 1, -1, .5) = (.183, .498, .067, .302): the 0.75-nucleus is {1, 3}
    nucleus = policy.sample(prompts, 2000, SamplingParams(top_p=0.75))
    assert set(nucleus.completion_ids[:, 0].tolist()) == {1, 3}


def test_values_table():
    policy = TabularPolicy(REF, value_head=True)
    with torch.no_grad():
        policy.value_table.copy_(torch.tensor([0.5, -1.0]))
        policy.terminal_table[1, 3] = 2.0
    v = policy.values(_batch([1, 0], [0, 0]))
    assert v.tolist() == [[-1.0], [0.5]] and v.requires_grad
    # a terminal filler column (what the reward-model plugin appends) reads V(x, y)
    b = _batch([1], [3])
    two = SequenceBatch(b.prompt_ids, b.prompt_mask, torch.tensor([[3, 0]]), torch.ones(1, 2, dtype=torch.bool))
    assert policy.values(two).tolist() == [[-1.0, 2.0]]


def test_reward_model_plugin_recovers_the_reward_up_to_a_constant():
    """algo=rm on Bradley-Terry pairs of r (scale 1) is the BT maximum-likelihood fit: r_hat - r is constant
    per prompt. 20k pairs per prompt: the largest error is 0.03-0.05 (data seeds 0-2); asserted < 0.1 (kind 3 and 4
    of tests/bounds.py: the Bradley-Terry fit's sampling error and 150 steps' optimisation error, measured over 3 data
    seeds, x 2; the seed is fixed, so the test is deterministic)."""
    bandit = TabularBandit(REF, REWARDS)
    cls = get_algorithm("rm")
    algo = cls(cls.config_class(), ObjectiveSettings(beta=0.0))
    policy = TabularPolicy(REF, with_reference=algo.declaration.reference, value_head=algo.declaration.value_head is not None)
    pairs = preference_pairs(bandit, 20_000, torch.Generator().manual_seed(0))
    train(algo, policy, PairSource(pairs), TrainSettings(steps=150, lr=0.1))
    learned = policy.terminal_table.detach().double()
    err = (learned - learned.mean(-1, keepdim=True)) - (bandit.rewards - bandit.rewards.mean(-1, keepdim=True))
    assert float(err.abs().max()) < 0.1


def test_scorer_and_prompt_source():
    scorer = TableScorer(REWARDS)
    assert scorer(_batch([0, 1], [1, 2])).tolist() == [1.0, 1.0]
    batch = PromptSource(2, repeats=3).next()
    assert isinstance(batch, PromptBatch) and batch.prompt_ids[:, 0].tolist() == [0, 1, 0, 1, 0, 1]
    drawn = PromptSource(2, batch_size=7, generator=torch.Generator().manual_seed(0)).next()
    assert len(drawn) == 7


def test_preference_pairs_follow_pi_ref_and_bradley_terry():
    """Pairs (a, b), a != b, have frequency pi_a pi_b / (1 - sum pi^2) per ordered draw; a is chosen over b
    with probability sigmoid((r_a - r_b) / s). 200k pairs: errors ~ 1e-3, asserted below 0.01 (the probabilities
    of a false failure: test_sample_is_grouped_reproducible_and_follows_the_policy)."""
    from prefzoo.data.preference import PreferenceBatch

    bandit = TabularBandit(REF, REWARDS)
    for scale in (1.0, 0.5):
        pairs = preference_pairs(bandit, 100_000, torch.Generator().manual_seed(0), bt_scale=scale)
        assert isinstance(pairs, PreferenceBatch) and len(pairs) == 200_000
        c, r = pairs.chosen.completion_ids[:, 0], pairs.rejected.completion_ids[:, 0]
        assert not bool((c == r).any())
        x = pairs.chosen.prompt_ids[:, 0]
        assert torch.equal(x, pairs.rejected.prompt_ids[:, 0])
        for prompt in (0, 1):
            sel = x == prompt
            lo, hi = torch.minimum(c[sel], r[sel]), torch.maximum(c[sel], r[sel])
            counts = torch.zeros(4, 4, dtype=torch.float64)
            counts.index_put_((lo, hi), torch.ones(len(lo), dtype=torch.float64), accumulate=True)
            p = torch.softmax(REF[prompt].double(), -1)
            expected = torch.triu(2 * p[:, None] * p[None, :], diagonal=1) / (1 - (p * p).sum())
            assert float((counts / counts.sum() - expected).abs().sum()) / 2 < 0.01
            # win rate of response 1 against response 3 (prompt 0: r = 1.0 vs 0.2)
            a, b = (1, 3) if prompt == 0 else (0, 2)
            pair = sel & (((c == a) & (r == b)) | ((c == b) & (r == a)))
            rate = float(((c == a) & pair).sum()) / float(pair.sum())
            expected_rate = 1 / (1 + math.exp(-float(REWARDS[prompt, a] - REWARDS[prompt, b]) / scale))
            assert abs(rate - expected_rate) < 0.02


def test_dpo_and_simpo_accept_the_pairs_unchanged():
    bandit = TabularBandit(REF, REWARDS)
    pairs = preference_pairs(bandit, 64, torch.Generator().manual_seed(0))
    for name, policy in (("dpo", TabularPolicy(REF)), ("simpo", TabularPolicy(REF, with_reference=False))):
        cls = get_algorithm(name)
        algo = cls(cls.config_class(), ObjectiveSettings(beta=0.5))
        out = algo.loss(policy, pairs)
        assert out.values.shape == (128,) and out.mask is None
        out.values.mean().backward()
        assert float(policy.logits.grad.abs().sum()) > 0


def test_driver_uses_the_shared_optimisation_step_and_the_loop_reexports_accumulate_gradients():
    """The driver's update is the Trainer's own (tests/training/test_step.py runs both and compares them)."""
    import prefzoo.lab.tabular as tabular
    import prefzoo.training.step as step

    assert tabular.optimisation_step is step.optimisation_step
    # the training loop must run the very same functions (checked on the source: importing the loop loads
    # transformers, ~10 s)
    loop_src = (Path(step.__file__).parent / "loop.py").read_text()
    assert "from prefzoo.training.step import accumulate_gradients" in loop_src
    assert "def accumulate_gradients" not in loop_src and "def optimisation_step" not in loop_src


def test_driver_online_offline_and_after_step(monkeypatch):
    """train() calls make_experience once per step, loss epochs*minibatches times, after_step once."""
    bandit = TabularBandit(REF, REWARDS)
    cls = get_algorithm("grpo")
    algo = cls(cls.config_class(num_samples=4, epochs=2, num_minibatches=2),
               ObjectiveSettings(beta=0.1, kl_estimator="k1", kl_placement="in_reward"))
    calls = {"exp": 0, "loss": 0, "after": 0}
    for name, key in (("make_experience", "exp"), ("loss", "loss"), ("after_step", "after")):
        original = getattr(algo, name)

        def wrapped(*a, _o=original, _k=key, **kw):
            calls[_k] += 1
            return _o(*a, **kw)
        monkeypatch.setattr(algo, name, wrapped)
    policy = TabularPolicy(REF)
    history = train(algo, policy, PromptSource(2, repeats=8), TrainSettings(steps=3, lr=0.01),
                    scorer=TableScorer(REWARDS))
    assert calls == {"exp": 3, "loss": 12, "after": 3} and len(history) == 3
    assert "reward" in history[0] and "loss" in history[0]
    with pytest.raises(TabularError, match="online"):
        train(algo, policy, PairSource(preference_pairs(bandit, 4, torch.Generator())), TrainSettings(steps=1))
    dpo = get_algorithm("dpo")(get_algorithm("dpo").config_class(), ObjectiveSettings(beta=0.5))
    with pytest.raises(TabularError, match="offline"):
        train(dpo, policy, PromptSource(2), TrainSettings(steps=1))


def test_tiled_replicas_are_independent_runs():
    """Two stacked replicas see different samples (their policies differ) yet both move toward pi*."""
    from prefzoo.objective import optimal_policy

    bandit = TabularBandit(REF, REWARDS)
    tiled = bandit.tile(2)
    cls = get_algorithm("grpo")
    algo = cls(cls.config_class(num_samples=8, scale_rewards="none"),
               ObjectiveSettings(beta=0.5, kl_estimator="k1", kl_placement="in_reward"))
    policy = TabularPolicy(tiled.ref_logits, seed=1)
    train(algo, policy, PromptSource(4, repeats=8), TrainSettings(steps=20, lr=0.05), scorer=TableScorer(tiled.rewards))
    probs = policy.probs().view(2, 2, 4)
    assert not torch.allclose(probs[0], probs[1])
    star = optimal_policy(bandit.ref_probs, bandit.rewards, 0.5)
    start = float(kl_divergence(bandit.ref_probs, star).sum())
    for s in range(2):
        assert float(kl_divergence(probs[s], star).sum()) < start


def test_unpaired_rows_split_each_pair_and_shuffle_the_rows():
    """3 pairs -> 6 rows: pair i's chosen as a desirable row (index 2i) and its rejected as an undesirable one
    (2i + 1), each with the pair's prompt, in the order of a permutation of the generator."""
    from prefzoo.lab.tabular import unpaired_rows
    from prefzoo.types import PreferenceBatch, SequenceBatch

    ones = torch.ones(3, 1, dtype=torch.bool)
    prompts = torch.tensor([[0], [1], [2]])
    pairs = PreferenceBatch(SequenceBatch(prompts, ones, torch.tensor([[3], [4], [5]]), ones),
                            SequenceBatch(prompts, ones, torch.tensor([[0], [1], [2]]), ones), index=torch.arange(3))
    rows = unpaired_rows(pairs, torch.Generator().manual_seed(0))
    order = torch.randperm(6, generator=torch.Generator().manual_seed(0))
    assert rows.index.tolist() == order.tolist()
    for k, i in enumerate(order.tolist()):
        pair, chosen = i // 2, i % 2 == 0
        assert bool(rows.labels[k]) == chosen and int(rows.prompt_ids[k, 0]) == pair
        assert int(rows.completion_ids[k, 0]) == (pair + 3 if chosen else pair)
