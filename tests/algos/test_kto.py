"""Tests for the KTO plugin (prefzoo.algos.kto), every number derived by hand from the paper's loss.

Ethayarajh et al. 2024, sec. 4.1 (eq. 8): r = log pi(y|x) - log pi_ref(y|x) summed over the completion,
z0 = max(0, mean of r over mismatched (prompt, completion) pairs), detached; a desirable row's loss is
lambda_D (1 - sigma(beta (r - z0))), an undesirable one's lambda_U (1 - sigma(beta (z0 - r))); the batch loss is
their mean. The policy is a stub whose log-prob of a completion token depends on the token and, where a test says
so, on the prompt (the last prompt token): every r below is a sum of table entries.

Tolerances (tests/bounds.py, kind 1: every claim here is exact). The stub's tables are float64 and KTO keeps float64
through (``sequence_logps``, ``kto_loss``, z0 and the metrics as Python floats; the class weights pass through
float32, exactly for the 1, 2 and 0.5 used here), so each value is its formula to a few roundings of numbers below 3
(u64 = 1.1e-16 relative each): against an exact fraction (1/3, 0.625, 0.15) or the formula evaluated by
:func:`sigmoid` the bound is 1e-12, over 1000x that rounding. Against a hand value written to 7 decimals it is 1e-6:
the written value is off by at most 6e-8 (one rounding, or two for 0.9916668 = 2 x 0.4958334), 16x below, and a wrong
formula moves these values by 1e-3 or more. The written values themselves are checked against :func:`sigmoid` within
1e-7 (one 7-decimal rounding, <= 5e-8). With the former float32 tables the values sat 3e-8 to 6e-8 from the written
ones (measured 2026-12-06), float32 rounding and the written value's together: 17x below 1e-6 at best, with no
derivation behind either bound.
"""

import logging
import math

import pytest
import torch

from prefzoo.algos.kto import KTO, KTOConfig, mismatched
from prefzoo.config import Config, resolve_objective
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.data.unpaired import UnpairedExample, collate_unpaired
from prefzoo.errors import PluginError
from prefzoo.objective import kto_loss
from prefzoo.training.step import accumulate_gradients, mean_metrics, step_statistics
from prefzoo.types import ObjectiveSettings, SequenceBatch, StepContext
from tests import background
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


class StubPolicy:
    """log pi(y_t | x) = theta[x, y_t], log pi_ref(y_t | x) = ref[x, y_t] (x = the prompt's last token), in float64.

    ``tokens`` sets theta[:, t] for every prompt (a token-only policy); ``pairs`` sets theta[x, t] itself.
    The reference gives every token -1 unless ``ref`` says otherwise."""

    def __init__(self, tokens: dict[int, float] = {}, pairs: dict[tuple[int, int], float] = {}, ref: float = -1.0,
                 vocab: int = 16):
        self.theta = torch.zeros(vocab, vocab, dtype=torch.float64)
        for t, v in tokens.items():
            self.theta[:, t] = v
        for (x, t), v in pairs.items():
            self.theta[x, t] = v
        self.theta.requires_grad_(True)
        self.ref = torch.full((vocab, vocab), ref, dtype=torch.float64)
        self.reference = "table"

    def _rows(self, batch: SequenceBatch) -> torch.Tensor:
        return batch.prompt_ids[:, -1:].expand_as(batch.completion_ids)

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False):
        return self.theta[self._rows(batch), batch.completion_ids].masked_fill(~batch.completion_mask, 0.0), None

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0):
        return self.ref[self._rows(batch), batch.completion_ids].masked_fill(~batch.completion_mask, 0.0)


#: token log-probs under the policy; the reference gives -1 per token
TOKENS = {1: -0.5, 2: -1.0, 3: -2.0, 4: -0.25}


def rows(*specs) -> "UnpairedBatch":  # noqa: F821
    """specs: (prompt token, completion tokens, desirable?)."""
    examples = [UnpairedExample([p], list(c), bool(d)) for p, c, d in specs]
    return collate_unpaired(examples, list(range(len(examples))), pad_id=0)


#: r: A (1, 2): -1.5 + 2 = 0.5, desirable; B (3,): -2 + 1 = -1, undesirable; C (4, 4): -0.5 + 2 = 1.5, desirable
ABC = [(5, (1, 2), True), (6, (3,), False), (7, (4, 4), True)]


def kto(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0) -> KTO:
    return KTO(KTOConfig(desirable_weight=desirable_weight, undesirable_weight=undesirable_weight),
               ObjectiveSettings(beta=beta))


def losses_of(algo: KTO, policy, batch, micro_batch_size=None):
    statistics = step_statistics(algo, policy, batch, micro_batch_size or len(batch))
    return algo.loss(policy, batch, StepContext(statistics=statistics))


def test_defaults_and_declaration():
    algo = KTO(KTOConfig(), resolve_objective(Config(algo=KTOConfig())))
    assert algo.beta == 0.1 and algo.cfg.desirable_weight is None and algo.cfg.undesirable_weight == 1.0
    assert algo.desirable_weight == 1.0  # until check_data sees the class counts
    d = algo.declaration
    assert d.reference and d.data == "unpaired" and d.min_batch_size == 2 and d.aggregation == "example_mean"
    assert d.has("step_statistics") and d.has("implicit_rewards")


def test_loss_hand_values():
    """r = (0.5, -1, 1.5) (ABC). Mismatched pairs: A's prompt with B's completion (r -1), B's with C's (1.5), C's with
    A's (0.5): z0 = max(0, 1/3) = 1/3. beta = 0.1:
      A desirable:   1 - sigma(0.1 (0.5 - 1/3)) = 1 - sigma(0.0166667) = 1 - 0.5041666 = 0.4958334
      B undesirable: 1 - sigma(0.1 (1/3 + 1))   = 1 - sigma(0.1333333) = 1 - 0.5332840 = 0.4667160
      C desirable:   1 - sigma(0.1 (1.5 - 1/3)) = 1 - sigma(0.1166667) = 1 - 0.5291336 = 0.4708664"""
    out = losses_of(kto(), StubPolicy(TOKENS), rows(*ABC))
    assert out.mask is None and out.metrics["kl"] == pytest.approx(1 / 3, abs=1e-12)
    want = torch.tensor([0.4958334, 0.4667160, 0.4708664], dtype=torch.float64)
    torch.testing.assert_close(out.values.detach(), want, rtol=0, atol=1e-6)


def test_weights_scale_each_class():
    """lambda_D = 2, lambda_U = 0.5: the same rows' losses times their class weight: 0.9916668, 0.2333580, 0.9417327."""
    out = losses_of(kto(desirable_weight=2.0, undesirable_weight=0.5), StubPolicy(TOKENS), rows(*ABC))
    want = torch.tensor([0.9916668, 0.2333580, 0.9417327], dtype=torch.float64)
    torch.testing.assert_close(out.values.detach(), want, rtol=0, atol=1e-6)


def test_gradients_hand_values_and_z0_is_detached():
    """d loss / d r = -lambda_D beta s (1 - s) (desirable, s = sigma(beta (r - z0))) or +lambda_U beta s (1 - s)
    (undesirable, s = sigma(beta (z0 - r))), with z0 held fixed: A -0.1 * 0.5041666 * 0.4958334 = -0.0249983,
    B +0.0248892, C -0.0249151. The batch loss is their mean (1/3 each); r_A = theta_1 + theta_2 + 2, r_B = theta_3 + 1,
    r_C = 2 theta_4 + 2, so d/dtheta_1 = d/dtheta_2 = -0.0083328, d/dtheta_3 = 0.0082964, d/dtheta_4 =
    2/3 (-0.0249151) = -0.0166101. Through z0 the tokens would get more (z0 = mean of the same r): they do not."""
    policy = StubPolicy(TOKENS)
    accumulate_gradients(kto(), policy, rows(*ABC), micro_batch_size=3)
    grad = policy.theta.grad[5:8].sum(0)  # the three prompts' rows of the table
    torch.testing.assert_close(grad[1:5], torch.tensor([-0.0083328, -0.0083328, 0.0082964, -0.0166101],
                                                       dtype=torch.float64), rtol=0, atol=1e-6)
    assert float(policy.theta.grad.abs().sum()) == pytest.approx(float(grad[1:5].abs().sum()), abs=1e-12)


@pytest.mark.parametrize("b", [2, 3, 5])
def test_the_mismatched_rows_rotate_by_one_and_never_pair_a_row_with_itself(b):
    """Row i keeps its prompt and takes row (i+1) mod B's completion; with distinct completions no row keeps its own."""
    batch = rows(*[(1 + i, (10 - i,) * (1 + i % 2), True) for i in range(b)])
    kl = mismatched(batch)
    for i in range(b):
        j = (i + 1) % b
        assert j != i
        assert torch.equal(kl.prompt_ids[i], batch.prompt_ids[i])
        assert torch.equal(kl.completion_ids[i], batch.completion_ids[j])
        assert torch.equal(kl.completion_mask[i], batch.completion_mask[j])


def test_z0_reads_each_prompt_with_the_next_rows_completion():
    """Prompts 1, 2, 3 with completions 4, 5, 6 (single tokens), reference 0: the rotation reads theta[1, 5] = 0.2,
    theta[2, 6] = 0.4, theta[3, 4] = -0.3, so kl = 0.3 / 3 = 0.1. (The rows' own pairs (1,4), (2,5), (3,6) and the
    other rotation (1,6), (2,4), (3,5) are 0 in the table.)"""
    policy = StubPolicy(pairs={(1, 5): 0.2, (2, 6): 0.4, (3, 4): -0.3}, ref=0.0)
    batch = rows((1, (4,), True), (2, (5,), False), (3, (6,), True))
    assert step_statistics(kto(), policy, batch, 3)["kl"] == pytest.approx(0.1, abs=1e-12)


#: ABC and D = (4, 4, 2): -1.5 + 3 = 1.5, undesirable
FOUR = [*ABC, (8, (4, 4, 2), False)]  # D: -0.25 - 0.25 - 1 + 3 = 1.5 (undesirable)


@pytest.mark.numerics
def test_z0_of_two_micro_batches_is_the_whole_steps_and_gives_the_same_loss_and_gradients():
    """r = 0.5, -1, 1.5, 1.5 (FOUR), beta = 1. One z0 for the step: mean 2.5 / 4 = 0.625. Per micro-batch of 2 it
    would be max(0, (0.5 - 1)/2) = 0 for A, B and 1.5 for C, D: other losses (A: 1 - sigma(0.5) = 0.3775407 instead of
    1 - sigma(-0.125) = 0.5312094; the batch loss 0.4116206 instead of 0.4239315). Micro-batches of 2 and of 1 give the
    loss and the gradients of one batch of 4: each gradient entry is then a sum of at most 4 row terms (< 0.5 each)
    taken in another order, in float64 (<= 3 u64 x 2 = 7e-16, sum_bound), within 1e-12; measured 0 at 1 and 2
    threads (2026-12-06)."""
    grads, totals = [], []
    for size in (4, 2, 1):
        policy, algo = StubPolicy(TOKENS), kto(beta=1.0)
        m = mean_metrics(accumulate_gradients(algo, policy, rows(*FOUR), micro_batch_size=size))
        assert m["kl"] == pytest.approx(0.625, abs=1e-12)
        grads.append(policy.theta.grad.clone())
        totals.append(m["loss"])
    want = (1 - sigmoid(0.5 - 0.625) + 1 - sigmoid(0.625 + 1) + 1 - sigmoid(1.5 - 0.625) + 1 - sigmoid(0.625 - 1.5)) / 4
    assert want == pytest.approx(0.4239315, abs=1e-7) and totals == pytest.approx([want] * 3, abs=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[2], grads[0], rtol=0, atol=1e-12)


def test_z0_is_clamped_after_averaging_over_the_step():
    """r = -2 (3, 3), -1 (3,), 0.5 (1,), 1 (1, 1). The step's mean is (-2 - 1 + 0.5 + 1) / 4 = -0.375: kl = -0.375 and
    z0 = max(0, -0.375) = 0 for every micro-batch. Clamping each micro-batch of 2 first would give z0 = 0 for the
    first and (0.5 + 1) / 2 = 0.75 for the second (and their mean 0.375). beta = 1; with z0 = 0 the losses are
    1 - sigma(r) (desirable: rows 1, 3) and 1 - sigma(-r) (undesirable: rows 2, 4): (0.8807971 + 0.2689414 +
    0.3775407 + 0.7310586) / 4 = 0.5645844 (with the second micro-batch at z0 = 0.75: 0.5685229)."""
    batch = rows((5, (3, 3), True), (6, (3,), False), (7, (1,), True), (8, (1, 1), False))
    policy, algo = StubPolicy(TOKENS), kto(beta=1.0)
    m = mean_metrics(accumulate_gradients(algo, policy, batch, micro_batch_size=2))
    assert m["kl"] == pytest.approx(-0.375, abs=1e-12)
    want = (1 - sigmoid(-2.0) + 1 - sigmoid(1.0) + 1 - sigmoid(0.5) + 1 - sigmoid(-1.0)) / 4
    assert want == pytest.approx(0.5645844, abs=1e-7) and m["loss"] == pytest.approx(want, abs=1e-12)


def test_z0_is_averaged_over_processes_before_the_clamp():
    """Two processes hold rows 1-2 and 3-4 of the clamp test. Process 1's own mean is -1.5 (z0 0 if it were alone),
    process 2's 0.75; the all-reduce adds both (sum, count) pairs: -1.5 / 4 = -0.375 on both, z0 = 0 on both."""
    batch = rows((5, (3, 3), True), (6, (3,), False), (7, (1,), True), (8, (1, 1), False))
    policy, algo = StubPolicy(TOKENS), kto()
    halves = [batch.select([0, 1]), batch.select([2, 3])]
    local = [torch.tensor([list(algo.step_statistics(policy, h, 2)["kl"])], dtype=torch.float64) for h in halves]
    for me, other in ((0, 1), (1, 0)):
        stats = step_statistics(algo, policy, halves[me], 2, all_reduce=lambda t, o=other: t + local[o])
        assert stats["kl"] == pytest.approx(-0.375, abs=1e-12)


def test_one_row_is_refused_and_a_process_without_rows_adds_nothing():
    policy, algo = StubPolicy(TOKENS), kto()
    with pytest.raises(PluginError, match="paired with itself"):
        algo.step_statistics(policy, rows(ABC[0]), 1)
    assert algo.step_statistics(policy, rows(*ABC).select([]), 2) == {"kl": (0.0, 0.0)}


def test_loss_without_the_step_statistics_pass_is_refused():
    with pytest.raises(PluginError, match="step_statistics"):
        kto().loss(StubPolicy(TOKENS), rows(*ABC))


def test_metrics_keep_trls_meaning():
    """FOUR, one step: rewards/chosen = beta x mean r of the desirable rows = 0.1 (0.5 + 1.5) / 2 = 0.1, rewards/rejected
    = 0.1 (-1 + 1.5) / 2 = 0.025, margins 0.075; logps/chosen = (-1.5 - 0.5) / 2 = -1, logps/rejected = (-2 - 1.5) / 2
    = -1.75; 2 desirable and 2 undesirable rows. The same with micro-batches of 1 (each class mean is taken over the
    step's rows of that class, not averaged over micro-batches)."""
    for size in (4, 1):
        algo = kto()
        m = mean_metrics(accumulate_gradients(algo, StubPolicy(TOKENS), rows(*FOUR), micro_batch_size=size))
        m.update(algo.after_step(m, 4))
        want = {"rewards/chosen": 0.1, "rewards/rejected": 0.025, "rewards/margins": 0.075, "logps/chosen": -1.0,
                "logps/rejected": -1.75, "count/desirable": 2.0, "count/undesirable": 2.0}
        for k, v in want.items():
            assert m[k] == pytest.approx(v, abs=1e-12), (size, k)


def test_rewards_are_zero_at_the_reference():
    policy = StubPolicy(ref=-1.0, tokens={t: -1.0 for t in range(16)})
    out = losses_of(kto(), policy, rows(*ABC))
    assert out.metrics["kl"] == 0.0 and out.token_metrics["rewards/chosen"][0] == 0.0  # -1 - (-1): no rounding
    torch.testing.assert_close(out.values.detach(), torch.full((3,), 0.5, dtype=torch.float64), rtol=0,
                               atol=1e-12)  # 1 - sigma(0)


def test_held_out_rewards_are_beta_log_ratios():
    """A pair with chosen (4, 4) (r 1.5) and rejected (3,) (r -1): implicit rewards 0.15 and -0.1."""
    pair = collate_preferences([PreferenceExample([5], [4, 4], [3])], [0], 0)
    chosen, rejected = kto().implicit_rewards(StubPolicy(TOKENS), pair)
    assert float(chosen) == pytest.approx(0.15, abs=1e-12) and float(rejected) == pytest.approx(-0.1, abs=1e-12)


@pytest.mark.parametrize("counts,weights,warns", [
    ((50, 50), (1.0, 1.0), False),  # ratio 1
    ((10, 90), (1.0, 1.0), True),  # 0.111
    ((10, 90), (10.0, 1.0), False),  # 1.111
    ((60, 40), (1.0, 1.0), True),  # 1.5
])
def test_class_balance_warning(caplog, counts, weights, warns):
    """lambda_D n_D / (lambda_U n_U) outside [1, 4/3] warns in one line with the range of desirable_weight that would
    fit: 10 desirable, 90 undesirable, weights 1: [9, 12]."""
    algo = kto(desirable_weight=weights[0], undesirable_weight=weights[1])
    with caplog.at_level(logging.INFO, logger="prefzoo.algos.kto"):
        algo.check_data({"desirable": counts[0], "undesirable": counts[1]})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) == warns
    assert any(f"{counts[0]} desirable, {counts[1]} undesirable" in r.getMessage() for r in caplog.records)
    if warns and counts == (10, 90):
        assert "algo.desirable_weight in [9, 12]" in warnings[0] and "\n" not in warnings[0]


@pytest.mark.parametrize("counts, undesirable_weight, expected", [
    ((10, 90), 1.0, 9.0),  # lambda_D = 1 x 90 / 10: ratio 9 x 10 / (1 x 90) = 1, the range's lower end
    ((204, 1716), 1.0, 1716 / 204),  # the built-in arithmetic rows' counts (docs/algorithms.md): 8.41
    ((30, 30), 2.0, 2.0),  # balanced classes: lambda_D = lambda_U
    ((0, 50), 1.0, 1.0),  # no desirable row: nothing to balance, 1.0 (and the warning says to give both labels)
])
def test_unset_desirable_weight_is_balanced_from_the_class_counts(caplog, counts, undesirable_weight, expected):
    """algo.desirable_weight unset -> lambda_D = lambda_U n_U / n_D, so lambda_D n_D / (lambda_U n_U) = 1 (the
    paper's recommended range [1, 4/3], sec. 4.1, at its lower end); the loss then uses it: one desirable row at
    log-ratio 0 with z0 = 0 loses lambda_D (1 - sigma(0)) = lambda_D / 2. lambda_D is Python float arithmetic (one
    multiplication and one division: <= 2 u64 = 2.2e-16 relative, bound 1e-12); the loss's weight goes through
    float32 (``kto_loss`` builds it with ``torch.where`` of Python floats, whatever the input's dtype): one rounding,
    <= u32 = 6e-8 relative (measured 4.7e-8 at 8.41), bound 1e-6."""
    algo = KTO(KTOConfig(undesirable_weight=undesirable_weight), resolve_objective(Config(algo=KTOConfig())))
    with caplog.at_level(logging.INFO, logger="prefzoo.algos.kto"):
        algo.check_data({"desirable": counts[0], "undesirable": counts[1]})
    assert algo.desirable_weight == pytest.approx(expected, rel=1e-12)
    assert algo.cfg.desirable_weight is None  # the config is not rewritten: config.yaml keeps what the user set
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warnings) == (counts[0] == 0)
    if counts[0]:
        assert any("(balanced: algo.desirable_weight unset)" in r.getMessage() for r in caplog.records)
        loss = kto_loss(torch.zeros(1), torch.tensor([True]), 0.0, 0.1, algo.desirable_weight, undesirable_weight)
        assert float(loss) == pytest.approx(expected / 2, rel=1e-6)


def test_a_set_desirable_weight_is_kept():
    algo = kto(desirable_weight=2.0)
    algo.check_data({"desirable": 10, "undesirable": 90})
    assert algo.desirable_weight == 2.0


# ------------------------------------------------------------------------------------------ the command line

def _command(base, args: list[str], env: dict | None = None) -> background.Command:
    """``python train.py <args> hydra.run.dir=<base>/run``."""
    import os
    import sys

    from tests.test_cli import ROOT

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return background.Command([sys.executable, "train.py", *args, f"hydra.run.dir={base / 'run'}"], ROOT, full_env)


def _file_run(base) -> background.Command:
    """2 steps on an unpaired file (the fixture's pairs written as 80 unpaired rows)."""
    import json

    from tests.test_cli import FIXTURE, ROOT, TINY_RUN

    pairs = [json.loads(line) for line in (ROOT / FIXTURE).read_text().splitlines()]
    unpaired = base / "unpaired.jsonl"
    unpaired.write_text("".join(json.dumps({"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"})
                                + "\n" for p in pairs for side in ("chosen", "rejected")))
    file_run = [a if not a.startswith(("algo=", "data.path=")) else a.replace("dpo", "kto") for a in TINY_RUN
                if not a.startswith("data.path=")] + [f"data.path={unpaired}", "trainer.save_every=0"]
    return _command(base, file_run)


def _builtin_run(base) -> background.Command:
    """2 steps on the built-in arithmetic rows of ``model=tiny`` (in a cache of its own)."""
    from prefzoo.models.loading import TOKENIZER_CACHE_NAME, cache_dir

    cache = base / "cache"
    cache.mkdir()
    (cache / TOKENIZER_CACHE_NAME).symlink_to(cache_dir() / TOKENIZER_CACHE_NAME)
    builtin = ["model=tiny", "algo=kto", "data.pairs.num_prompts=8", "data.pairs.eval_prompts=4",
               "data.pairs.max_new_tokens=8", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.progress=false",
               "trainer.tensorboard=false", "trainer.device=cpu", "trainer.num_threads=1", "trainer.save_every=0",
               "eval.num_problems=4", "eval.max_new_tokens=8", "eval.diversity_prompts=2", "eval.diversity_samples=2"]
    return _command(base, builtin, {"PREFZOO_CACHE": str(cache)})


#: the command-line runs, in the background (tests/background.py)
CLI_RUNS = {"file": background.register("kto_file_run", __name__, _file_run),
            "builtin": background.register("kto_builtin_run", __name__, _builtin_run)}


@pytest.fixture(scope="module")
def cli_runs():
    """{name: (returncode, stdout, stderr, run folder)} of the command-line runs."""
    out = {}
    for name, job in CLI_RUNS.items():
        result = job.result()
        out[name] = (result.returncode, result.stdout, result.stderr, result.base / "run")
    return out


def test_cfg_job_shows_kto_and_its_defaults():
    """What ``python train.py --cfg job algo=kto model=tiny`` prints, composed in this process (tests/test_cli.py's
    cfg_job: the real command's output is that, checked there)."""
    from tests.test_cli import cfg_job

    stdout = cfg_job("algo=kto", "model=tiny")
    assert "algo:\n  name: kto\n" in stdout and "\n  default_beta: 0.1\n" in stdout
    assert "\n  desirable_weight: null\n  undesirable_weight: 1.0\n" in stdout


def _metrics(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~10 s of CPU: 2 steps and 2 evaluations of the tiny model
def test_two_steps_on_an_unpaired_file_from_the_command_line(cli_runs):
    """Step 1 starts at the reference (LoRA's B = 0): every log-ratio is 0, so kl = 0, every reward 0, loss
    1 - sigma(0) = 0.5 exactly; the step moves the policy, so step 2's kl is no longer 0."""
    rc, stdout, stderr, run_dir = cli_runs["file"]
    assert rc == 0, stderr[-3000:]
    first, second = _metrics(run_dir)
    # exact: with every log-ratio exactly 0 nothing is rounded (sigma(0) = 1/2, means of equal values)
    assert first["kl"] == 0.0 and first["loss"] == 0.5 and first["rewards/chosen"] == 0.0
    assert first["count/desirable"] + first["count/undesirable"] == 2.0 and second["kl"] != 0.0
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert "76 unpaired training rows (38 desirable, 38 undesirable)" in stderr + stdout


@pytest.mark.slow  # ~15 s of CPU: the tiny model samples 8 + 4 prompts x 6, 2 KTO steps, 2 evaluations
def test_two_steps_on_the_built_in_rows_from_the_command_line(cli_runs):
    """The random tiny model never answers right: its 48 samples are undesirable rows and the 8 known answers the
    desirable ones; algo.desirable_weight unset balances them, lambda_D = 48 / 8 = 6 (no warning);
    the held-out pairs give a preference accuracy."""
    import json

    rc, stdout, stderr, run_dir = cli_runs["builtin"]
    assert rc == 0, stderr[-3000:]
    log = stdout + stderr
    assert "56 unpaired training rows (8 desirable, 48 undesirable)" in log
    assert "lambda_D = 6 (balanced: algo.desirable_weight unset)" in log and "outside the paper's" not in log
    assert [m["step"] for m in _metrics(run_dir)] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["data_stats"]["rows"] == {"desirable": 8, "undesirable": 48}
    assert "preference_accuracy" in summary["eval_after"] and summary["results"]["train_kl"] is None
