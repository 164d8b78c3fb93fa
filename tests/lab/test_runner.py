"""The lab's one runner (prefzoo.lab.runner): the conformance table and the toy bandit train through it."""

import pytest
import torch

import prefzoo.lab.conformance as conformance
import prefzoo.lab.runner as runner
import prefzoo.lab.toy as toy
from prefzoo.lab.tabular import PairSource, TabularBandit, TabularPolicy, TrainSettings, preference_pairs, train
from tests.models.helpers import one_thread_fixture

REF = torch.tensor([[0.0, 1.0, -1.0, 0.5], [2.0, 0.0, 0.0, -2.0]])
REWARDS = torch.tensor([[0.0, 1.0, 0.5, 0.2], [0.3, 0.0, 1.0, 0.6]])


@pytest.fixture(autouse=True)
def one_thread():
    yield from one_thread_fixture()


def test_conformance_and_toy_train_through_the_one_runner(monkeypatch):
    """Both drivers bind runner.train_replicas and call it once per trained case / beta, with their own sizes:
    conformance SAMPLES_PER_PROMPT 1024 and PAIRS_PER_PROMPT 10000, the toy 512 (32 groups of 16) and 20000."""
    assert conformance.train_replicas is runner.train_replicas and toy.train_replicas is runner.train_replicas
    calls = []

    def spy(algo, bandit, replicas, seed, steps, lr, **kw):
        calls.append((algo.name, bandit.name, replicas, steps, kw["samples_per_prompt"], kw["pairs_per_prompt"]))
        return runner.train_replicas(algo, bandit, replicas, seed, steps, lr, **kw)
    monkeypatch.setattr(conformance, "train_replicas", spy)
    monkeypatch.setattr(toy, "train_replicas", spy)
    case = next(c for c in conformance.default_cases() if c.label == "GRPO k1 in reward")
    conformance.run_case(case, conformance.conformance_bandit(), seeds=2, steps=2, samples_per_prompt=32)
    toy.train_toy(toy.toy_bandit(), 0.5, "grpo", replicas=2, steps=2)
    assert calls == [("grpo", "conformance", 2, 2, 32, 10000), ("grpo", "toy", 2, 2, 512, 20000)]


def test_reference_logps_are_filled_in_once_from_the_reference_table():
    """with_reference_logps: the summed reference log-probs of chosen and rejected are log softmax(REF) at the
    pair's response (one token per response), written out here; pairs that carry them come back unchanged. The same
    float32 log-softmax of the same table: equal bit for bit (kind 1 of tests/bounds.py; measured 0; the bound was
    assert_close's float32 default, atol 1e-5)."""
    pairs = preference_pairs(TabularBandit(REF, REWARDS), 5, torch.Generator().manual_seed(0))
    algo = runner.build_algorithm("dpo", {}, {}, beta=0.5)
    filled = runner.with_reference_logps(algo, TabularPolicy(REF), pairs)
    rows = pairs.chosen.prompt_ids[:, -1]
    log_ref = torch.log_softmax(REF, -1)
    torch.testing.assert_close(filled.ref_chosen_logps, log_ref[rows, pairs.chosen.completion_ids[:, 0]],
                               rtol=0, atol=0)
    torch.testing.assert_close(filled.ref_rejected_logps, log_ref[rows, pairs.rejected.completion_ids[:, 0]],
                               rtol=0, atol=0)
    assert runner.with_reference_logps(algo, TabularPolicy(REF), filled) is filled


def test_reference_logps_computed_once_train_exactly_as_per_micro_batch():
    """The runner fills DPO's reference log-probs in once (the conformance table always did; the toy computed them
    in every micro-batch): the same per-row sums, so the trained logits are bit-identical either way."""
    bandit = TabularBandit(REF, REWARDS)
    pairs = preference_pairs(bandit.tile(2), 200, torch.Generator().manual_seed(1))
    algo = runner.build_algorithm("dpo", {}, {}, beta=0.3)
    via_runner = runner.train_replicas(algo, bandit, 2, 0, 30, 0.2, samples_per_prompt=0, pairs_per_prompt=0,
                                       pairs=pairs)
    direct = TabularPolicy(bandit.tile(2).ref_logits, seed=0)
    train(runner.build_algorithm("dpo", {}, {}, beta=0.3), direct, PairSource(pairs), TrainSettings(steps=30, lr=0.2))
    assert not torch.equal(direct.logits, TabularPolicy(bandit.tile(2).ref_logits).logits)
    assert torch.equal(via_runner.logits, direct.logits)
