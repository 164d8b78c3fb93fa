"""Tests for the DPO plugin (prefzoo.algos.dpo): loss types, f-divergence links, gradients, reference log-probs.

Most tests run the plugin on ``TablePolicy``, a stub whose per-token log-prob depends only on the token
id (a table), so every expected number can be derived by hand in the docstrings. The gradient test
runs the real tiny Llama in float64 against central finite differences.

Tolerances (tests/bounds.py, kind 1 unless a test says otherwise). The table's log-probs are dyadic (-0.25 ... -2),
so they and their sums and differences are exact in float32; the plugin evaluates its links in float64 and rounds
each loss once to float32 (u32 = 2^-24 relative). A hand value quoted to d decimals (correctly rounded: checked
against the formulas, 2026-12-06) carries up to half a unit of its last decimal (``HAND6`` = 5e-7, ``HAND7`` = 5e-8),
and the two float32 roundings (the loss, and the float32 tensor of the hand value) 2 u32 |x|: atol HAND + rtol
2 u32 (:func:`hand` for scalars). An exact (dyadic) or float64 hand value: 2 u32 relative. The metrics
beta log(pi/pi_ref) are float32 products of beta (rounded to float32) and an exact log-ratio: 2 u32 relative; those
of float64 links are float64 (~1e-16). Nothing here sums more than 6 terms: no thread count changes a result.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from prefzoo.types import ObjectiveSettings, SequenceBatch
from prefzoo.algos.dpo import DPO, DPOConfig
from prefzoo.objective import ObjectiveError, pairwise_loss
from prefzoo.data.preference import PreferenceBatch, PreferenceExample, collate_preferences
from prefzoo.models.lora import wrap_trainable
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.reference import make_reference
from tests.bounds import U32, gamma
from tests.models.helpers import SPREAD, lora_settings, one_thread_fixture, tiny_model, tokenizer


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


#: half a unit in the last decimal of a hand value quoted to 6 or 7 decimals (module docstring)
HAND6, HAND7 = 5e-7, 5e-8


def hand(x: float, decimals: int = 6):
    """``pytest.approx`` of a hand value quoted to ``decimals`` decimals: its rounding plus two float32 roundings."""
    return pytest.approx(x, abs=0.5 * 10.0 ** -decimals + 2 * U32 * abs(x))


class TablePolicy:
    """log pi(token) = policy[token], log pi_ref(token) = ref[token], whatever the prompt or position.

    Counts the forward passes, so tests can check chosen and rejected share one.
    """

    def __init__(self, policy: dict[int, float], ref: dict[int, float] | None, vocab: int = 16):
        self.theta = torch.zeros(vocab)
        for t, v in policy.items():
            self.theta[t] = v
        self.theta.requires_grad_(True)
        self.ref = None
        if ref is not None:
            self.ref = torch.zeros(vocab)
            for t, v in ref.items():
                self.ref[t] = v
        self.reference = "table" if ref is not None else None
        self.logps_calls = self.ref_calls = 0

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False):
        self.logps_calls += 1
        return self.theta[batch.completion_ids].masked_fill(~batch.completion_mask, 0.0), None

    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0):
        if self.ref is None:
            raise AssertionError("the reference was used")
        self.ref_calls += 1
        return self.ref[batch.completion_ids].masked_fill(~batch.completion_mask, 0.0)


#: policy log-probs per token; the reference gives every token log-prob -1.
POLICY = {1: -0.5, 2: -1.0, 3: -2.0, 4: -0.25}
REF = {t: -1.0 for t in range(1, 16)}


def pairs(prompts=((5, 6), (7,))) -> PreferenceBatch:
    """Pair A: chosen (1, 2), rejected (3, 4); pair B: chosen (3,), rejected (4, 4, 1).

    Hand computation (reference log-prob -1 per token):
      A: log pi(y_w) = -0.5 - 1 = -1.5, log pi_ref = -2 -> rho_w = +0.5
         log pi(y_l) = -2 - 0.25 = -2.25, log pi_ref = -2 -> rho_l = -0.25;   h_A = rho_w - rho_l = 0.75
      B: log pi(y_w) = -2, log pi_ref = -1 -> rho_w = -1
         log pi(y_l) = -0.25 - 0.25 - 0.5 = -1, log pi_ref = -3 -> rho_l = +2;  h_B = -3
    With beta = 0.1 the DPO margins are m = beta h: m_A = 0.075, m_B = -0.3.
    """
    examples = [PreferenceExample(list(prompts[0]), [1, 2], [3, 4]), PreferenceExample(list(prompts[1]), [3], [4, 4, 1])]
    return collate_preferences(examples, [0, 1], pad_id=0)


def dpo(loss_type="sigmoid", label_smoothing=0.0, beta=0.1, divergence="reverse_kl", alpha=0.5,
        ipo_average_log_ratio=True) -> DPO:
    return DPO(DPOConfig(loss_type=loss_type, label_smoothing=label_smoothing,
                         ipo_average_log_ratio=ipo_average_log_ratio),
               ObjectiveSettings(beta=beta, divergence=divergence, alpha=alpha))


def losses(algo: DPO, batch=None) -> torch.Tensor:
    out = algo.loss(TablePolicy(POLICY, REF), batch if batch is not None else pairs())
    assert out.mask is None and out.values.shape == (2,)
    return out.values.detach()


# ------------------------------------------------------------------------------------- loss types

def test_sigmoid_loss_hand_values():
    """-log sigma(m) = softplus(-m): A: log(1 + e^-0.075) = 0.656350; B: log(1 + e^0.3) = 0.854355."""
    torch.testing.assert_close(losses(dpo("sigmoid")), torch.tensor([0.656350, 0.854355]), rtol=2 * U32, atol=HAND6)


def test_label_smoothed_loss_hand_values():
    """-(1-e) log sigma(m) - e log sigma(-m) = softplus(-m) + e m (since softplus(m) = m + softplus(-m)).
    e = 0.1: A: 0.656350 + 0.0075 = 0.663850; B: 0.854355 - 0.03 = 0.824355."""
    torch.testing.assert_close(losses(dpo("sigmoid", 0.1)), torch.tensor([0.663850, 0.824355]), rtol=2 * U32,
                               atol=HAND6)


def test_sigmoid_norm_averages_each_sides_log_ratio_hand_values():
    """TRL 1.16's sigmoid_norm: -log sigma(beta (rho_w/|y_w| - rho_l/|y_l|)). A: 0.5/2 - (-0.25)/2 = 0.375,
    m = 0.0375, loss log(1 + e^-0.0375) = 0.6745730; B: -1/1 - 2/3 = -5/3, m = -1/6, loss log(1 + e^(1/6)) =
    0.7799487 (plain sigmoid on the sums: 0.656350, 0.854355). The logged rewards stay the summed ones (TRL's).
    B's average 2/3 is rounded to float32 (u32 (2/3 + 5/3) on h, beta times that on the loss: 1.4e-8); with B's
    hand value 2.5e-8 from its formula the worst case, 1.3e-7, stays inside HAND7 + 2 u32 |x| = 1.4e-7."""
    torch.testing.assert_close(losses(dpo("sigmoid_norm")), torch.tensor([0.6745730, 0.7799487]), rtol=2 * U32,
                               atol=HAND7)
    out = dpo("sigmoid_norm").loss(TablePolicy(POLICY, REF), pairs())
    rewards_chosen = out.token_metrics["rewards/chosen"][0] / out.token_metrics["rewards/chosen"][1]
    assert rewards_chosen == pytest.approx(0.1 * (0.5 - 1) / 2, rel=2 * U32)  # beta in float32 times an exact ratio


def test_ipo_loss_on_summed_log_ratios_hand_values():
    """IPO with eq. 17 read literally on summed log-ratios (``ipo_average_log_ratio=false``) regresses
    h = rho_w - rho_l to 1/(2 beta) = 5: A: (0.75 - 5)^2 = 18.0625; B: (-3 - 5)^2 = 64 (exact values: 2 u32
    relative, module docstring)."""
    torch.testing.assert_close(losses(dpo("ipo", ipo_average_log_ratio=False)), torch.tensor([18.0625, 64.0]),
                               rtol=2 * U32, atol=0)


def test_ipo_averages_each_sides_log_ratio_over_its_tokens():
    """The hardening issue's pair (IPO authors' code and TRL average each side's log-ratio before eq. 17):
    beta 0.1; chosen 4 completion tokens, policy -1.0 and reference -1.5 per token (mean log-ratio 0.5);
    rejected 2 tokens, policy -2.0 and reference -1.0 per token (mean log-ratio -1.0). h = 0.5 - (-1.0) = 1.5,
    loss (1.5 - 1/(2*0.1))^2 = (1.5 - 5)^2 = 12.25. At the start (policy = reference) h = 0: loss 25.
    (Summed, h would be 4 * 0.5 - 2 * (-1.0) = 4: loss 1.0, a target that depends on length.) Exact (dyadic) hand
    values: 2 u32 relative (module docstring)."""
    prompt = [7, 8]
    examples = [PreferenceExample(prompt, [1, 1, 1, 1], [2, 2])]
    batch = collate_preferences(examples, [0], pad_id=0)

    class PerToken:
        def __init__(self, chosen, rejected):
            self.values = (chosen, rejected)

        def __call__(self, both):  # rows: chosen then rejected
            out = torch.zeros(both.completion_mask.shape)
            out[0], out[1] = self.values
            return out.masked_fill(~both.completion_mask, 0.0)

    class Fixed:
        reference, tractable_logps, analytic_kl = True, True, None

        def __init__(self, pol, ref):
            self.pol, self.ref = pol, ref

        def logps(self, both, temperature=1.0, with_entropy=False):
            return self.pol(both).requires_grad_(), None

        def ref_logps(self, both, temperature=1.0):
            return self.ref(both)

    policy = Fixed(PerToken(-1.0, -2.0), PerToken(-1.5, -1.0))
    assert float(dpo("ipo").loss(policy, batch).values[0].detach()) == pytest.approx(12.25, rel=2 * U32)
    summed = float(dpo("ipo", ipo_average_log_ratio=False).loss(policy, batch).values[0].detach())
    assert summed == pytest.approx(1.0, rel=2 * U32)
    start = Fixed(PerToken(-1.5, -1.0), PerToken(-1.5, -1.0))
    assert float(dpo("ipo").loss(start, batch).values[0].detach()) == pytest.approx(25.0, rel=2 * U32)


def test_hinge_loss_hand_values():
    """SLiC hinge max(0, 1 - m): A: 1 - 0.075 = 0.925; B: 1 + 0.3 = 1.3; a margin above 1 gives 0. Exact decimals:
    2 u32 relative (module docstring); the clamp's 0 is exact."""
    torch.testing.assert_close(losses(dpo("hinge")), torch.tensor([0.925, 1.3]), rtol=2 * U32, atol=0)
    torch.testing.assert_close(losses(dpo("hinge", beta=2.0)), torch.tensor([0.0, 7.0]), rtol=2 * U32, atol=0)


def test_pairwise_loss_rejects_unknown_type():
    with pytest.raises(ObjectiveError, match="sigmoid"):
        pairwise_loss(torch.zeros(1), "nope", 0.1)


def step_means(out) -> dict[str, float]:
    """A LossOutput's metrics as the loop logs them: per-row means, and per-pair (sum, count) pairs divided."""
    return {**out.metrics, **{k: v / n for k, (v, n) in out.token_metrics.items()}}


def test_metrics_hand_values():
    """rewards/chosen|rejected are beta log(pi/pi_ref), as TRL and the DPO paper log them: chosen log-ratios
    0.5 and -1.0 (mean -0.25) -> 0.1 * -0.25 = -0.025; rejected -0.25 and 2.0 (mean 0.875) -> 0.0875. Margins
    (0.075 - 0.3) / 2 = -0.1125, accuracy 1/2; logps/chosen (-1.5 - 2) / 2 = -1.75. Within 2 u32 relative (module
    docstring; the log-probs and log-ratios are exact; the old abs 1e-6 was up to 40 times looser)."""
    m = step_means(dpo().loss(TablePolicy(POLICY, REF), pairs()))
    want = {"rewards/chosen": -0.025, "rewards/rejected": 0.0875, "rewards/margins": -0.1125,
            "rewards/accuracies": 0.5, "logps/chosen": -1.75, "logps/rejected": -1.625,
            "log_ratio/chosen": -0.25, "log_ratio/rejected": 0.875}
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=2 * U32), k


def test_chosen_and_rejected_share_one_forward_pass():
    policy = TablePolicy(POLICY, REF)
    dpo().loss(policy, pairs())
    assert policy.logps_calls == 1 and policy.ref_calls == 1


# ---------------------------------------------------------------------------------- f-divergences

def test_reverse_kl_f_dpo_is_exactly_the_sigmoid_dpo_loss():
    """On random log-probs, the plugin with objective=reverse_kl gives -log sigma(beta (rho_w - rho_l))
    (Rafailov et al. 2023, eq. 7), computed here directly. Float64 on both sides (``rewards`` and the link are
    float64): a few roundings of numbers below 10, ~1e-15; atol 1e-12 leaves 1000x."""
    g = torch.Generator().manual_seed(0)
    algo = dpo(beta=0.3)
    pw, pl, rw, rl = (-5 * torch.rand(64, generator=g, dtype=torch.float64) for _ in range(4))
    cw, cl = algo.rewards(pw - rw, pl - rl)
    got = pairwise_loss(cw - cl, "sigmoid", algo.beta)
    want = -F.logsigmoid(0.3 * ((pw - rw) - (pl - rl)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("divergence,link", [
    ("forward_kl", lambda r: -math.exp(-r)),                                   # f'(u) = -1/u
    ("js", lambda r: math.log(2 * math.exp(r) / (1 + math.exp(r)))),           # f'(u) = log(2u/(1+u))
    ("alpha", lambda r: (1 - math.exp(-0.5 * r)) / 0.5),                       # f'(u) = (1 - u^-a)/a, a=0.5
])
def test_other_divergences_change_the_link_and_the_loss(divergence, link):
    """Wang et al. 2024: the implicit reward is beta f'(pi/pi_ref), u = e^rho. Pair A has rho_w = 0.5,
    rho_l = -0.25; pair B rho_w = -1, rho_l = 2 (see ``pairs``). E.g. forward KL, pair A:
    m = 0.1 (-e^-0.5 + e^0.25) = 0.067749, loss softplus(-0.067749) = 0.659846 (reverse KL: 0.656350).
    The float64 hand value and the float64 link, each rounded once to float32: 2 u32 relative."""
    rho = [(0.5, -0.25), (-1.0, 2.0)]
    want = torch.tensor([softplus(-0.1 * (link(w) - link(lo))) for w, lo in rho])
    got = losses(dpo(divergence=divergence))
    torch.testing.assert_close(got, want, rtol=2 * U32, atol=0)
    assert (got - losses(dpo())).abs().max() > 1e-3  # differs from reverse KL


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "js", "alpha"])
def test_a_rejected_answer_pushed_far_down_gives_a_finite_loss_and_gradient(divergence):
    """Token 5 has log-prob -101 under the policy and -1 under the reference: a rejected answer (5,) has
    log-ratio -100 nats. Forward KL's link -1/u = -e^100 overflows float32 (e^88.7 is its limit), and
    0 * log sigma(-inf) is NaN: the loss must stay finite (~0: the pair is won by a huge margin) and so must
    its gradient."""
    policy = TablePolicy({**POLICY, 5: -101.0}, REF)
    batch = collate_preferences([PreferenceExample([6], [1, 2], [5])], [0], pad_id=0)
    out = dpo(divergence=divergence).loss(policy, batch)
    out.values.sum().backward()
    assert torch.isfinite(out.values).all() and float(out.values) < 1e-3
    assert torch.isfinite(policy.theta.grad).all()
    assert out.values.dtype == torch.float32


def test_label_smoothing_far_from_the_reference_hand_value():
    """Same pair, reverse KL, eps = 0.1: m = 0.1 (0.5 + 100) = 10.05, loss softplus(-m) + eps m = 1.005043. The
    log-ratios are exact (integers and halves), the link float64, the loss rounded once to float32: 2 u32
    relative (the old abs 1e-6 was 8 times that)."""
    policy = TablePolicy({**POLICY, 5: -101.0}, REF)
    batch = collate_preferences([PreferenceExample([6], [1, 2], [5])], [0], pad_id=0)
    out = dpo(label_smoothing=0.1).loss(policy, batch).values
    assert float(out) == pytest.approx(softplus(-10.05) + 1.005, rel=2 * U32)


def test_held_out_preference_accuracy_counts_ties_as_half():
    """Before training, DPO's policy IS its reference: every implicit reward is beta (log-ratio 0), so chosen
    and rejected tie on every held-out pair: a coin flip, 0.5."""
    from prefzoo.config import EvalConfig
    from prefzoo.evaluation.evaluate import Evaluator

    policy = lora_policy()
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.zero_()  # the starting policy
    evaluator = Evaluator(policy, reward_fn=None, prompts=None, cfg=EvalConfig(), preference_examples=real_pairs(),
                          implicit_rewards=dpo().implicit_rewards)
    assert evaluator.preference_metrics()["preference_accuracy"] == 0.5


def test_alpha_parameter_is_used():
    assert (losses(dpo(divergence="alpha", alpha=0.2)) - losses(dpo(divergence="alpha", alpha=0.8))).abs().max() > 1e-3


# ---------------------------------------------------------------------------------- reference log-probs

def test_precomputed_reference_logps_give_the_same_loss():
    """Reference log-probs carried by the batch (algo.precompute_ref_logps) are used instead of a
    reference forward, and give the same loss: here the hand values -2, -2 (A) and -1, -3 (B). The same dyadic
    reference log-probs either way, so the same float64 computation: compared exactly."""
    batch = pairs()
    batch.ref_chosen_logps = torch.tensor([-2.0, -1.0])
    batch.ref_rejected_logps = torch.tensor([-2.0, -3.0])
    policy = TablePolicy(POLICY, ref=None)  # any reference forward would raise
    out = dpo().loss(policy, batch).values.detach()
    torch.testing.assert_close(out, losses(dpo()), rtol=0, atol=0)


def real_pairs():
    rows = [([1, 100, 200], [300, 400, 2], [500, 2]), ([1, 7, 8, 9, 10, 11], [12, 2], [13, 14, 15, 16, 2]),
            ([42], [43, 44, 45, 2], [46, 47, 2])]
    return [PreferenceExample(p, c, r) for p, c, r in rows]


def lora_policy(dtype=torch.float32, reference_mode="auto"):
    torch.manual_seed(0)
    model = wrap_trainable(tiny_model(initializer_range=SPREAD).to(dtype), lora_settings(), quantized=False,
                           adapter_path=None, gradient_checkpointing=False)
    with torch.no_grad():  # a policy that differs from its reference
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(n)))
    ref = make_reference(model, lora_enabled=True, adapter_loaded=False, mode=reference_mode)
    return CausalLMPolicy(model, tokenizer(), ref)


@pytest.mark.numerics
def test_precomputed_reference_logps_equal_per_batch_ones_on_the_tiny_model():
    """Reference log-probs computed once, one pair at a time (as a cache would), then carried by a batch of
    three: same loss as the per-batch reference forward, to the precision the cache keeps.

    The bound (kind 1, derived). The model is float64, so the per-pair and the batched reference passes differ by
    float64 rounding only (the log-softmax over V = 49152: lambda sqrt(V) u64 = 2.5e-13 per token, probabilistic,
    times the <= 10 tokens of a pair and beta: < 1e-12). What differs is the cache: collate_preferences stores it in
    float32 (u32 |ref| per side), which moves the sigmoid loss by at most beta u32 (|ref_w| + |ref_l|) (its slope in
    each reference log-prob is beta sigma(-m) <= beta); and each loss is rounded once to float32 (u32 |loss| each).
    In a float32 model the two passes (another batch shape, other padding) differ by rounding through two decoder
    layers, which has no short derivation: hence float64."""
    policy = lora_policy(torch.float64)
    algo = dpo()
    examples = real_pairs()
    cache = {}
    for i, e in enumerate(examples):
        c, r = algo.reference_logps(policy, collate_preferences([e], [i], policy.pad_id))
        cache[i] = (float(c), float(r))
    per_batch = collate_preferences(examples, [0, 1, 2], policy.pad_id)
    cached = collate_preferences(examples, [0, 1, 2], policy.pad_id, ref_logps=cache)
    assert cached.ref_chosen_logps is not None
    with torch.no_grad():
        a, b = algo.loss(policy, per_batch).values, algo.loss(policy, cached).values
    refs = torch.tensor([abs(c) + abs(r) for c, r in cache.values()], dtype=torch.float64)
    bound = algo.beta * U32 * refs + 2 * U32 * a.double().abs() + 1e-12
    gap = (b.double() - a.double()).abs()
    assert bool((gap <= bound).all()), (gap, bound)
    assert (a - math.log(2)).abs().max() > 1e-3  # policy != reference, so the test is not trivial


# ----------------------------------------------------------------------------------------- gradient

@pytest.mark.numerics
def test_dpo_gradient_matches_central_finite_differences_on_the_tiny_model():
    """d loss / d theta of the LoRA parameters (float64 model, reference = adapter disabled) against
    central differences D(e) = (L(theta + e v) - L(theta - e v)) / 2e along three directions: the gradient
    itself, a random direction and one single coordinate, e = 1e-3.

    The bound, derived. D(e) = L' + a e^2 + O(e^4) + r(e): the plugin rounds each pair's loss to float32 and the
    mean of the 3 is float32, so one evaluation is within delta = (u32 + gamma_3) L of its exact value (the losses
    are > 0) and r(e) <= (delta_up + delta_down) / 2e (5e-4 here). The truncation a e^2 is read off the differences
    themselves: D(2e) - D(e) = 3 a e^2 + r(2e) - r(e), so |a| e^2 <= (|D(2e) - D(e)| + r(e) + r(2e)) / 3, counted
    twice for the O(e^4) terms; the backward of the float32 cast adds 2 u32 |L'|. Bounds 2.6e-3, 1.4e-3 and 1.1e-3
    against gaps of 1.2e-3, 9.7e-5 and 2.6e-4 (at 1 and 2 threads; the old rel 2e-3 allowed 3.2e-2 on the
    gradient direction). A wrong gradient is off by O(|L'|) = 1.6 to 16."""
    policy = lora_policy(torch.float64)
    algo = dpo(beta=0.5)
    batch = collate_preferences(real_pairs(), [0, 1, 2], policy.pad_id)
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def loss() -> torch.Tensor:
        return algo.loss(policy, batch).values.mean()

    policy.model.zero_grad()
    loss().backward()
    grad = [p.grad.detach().clone() for p in params]
    norm = math.sqrt(sum(float((g * g).sum()) for g in grad))
    assert norm > 1e-3
    gen = torch.Generator().manual_seed(1)
    random_dir = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
    k = max(range(len(grad)), key=lambda i: float(grad[i].abs().max()))
    coord = [torch.zeros_like(p) for p in params]
    coord[k].view(-1)[int(grad[k].abs().argmax())] = 1.0
    def central(direction, eps) -> tuple[float, float]:
        """D(eps) and its rounding bound r(eps)."""
        with torch.no_grad():
            for p, v in zip(params, direction):
                p.add_(eps * v)
            up = float(loss())
            for p, v in zip(params, direction):
                p.add_(-2 * eps * v)
            down = float(loss())
            for p, v in zip(params, direction):
                p.add_(eps * v)
        return (up - down) / (2 * eps), (U32 + gamma(3)) * (abs(up) + abs(down)) / (2 * eps)

    eps = 1e-3
    for direction in ([g / norm for g in grad], random_dir, coord):
        analytic = sum(float((g * v).sum()) for g, v in zip(grad, direction))
        (numeric, r1), (coarse, r2) = central(direction, eps), central(direction, 2 * eps)
        truncation = (abs(coarse - numeric) + r1 + r2) / 3
        bound = 2 * truncation + r1 + 2 * U32 * abs(analytic)
        assert abs(numeric - analytic) <= bound, (numeric, analytic, bound)


def test_rewards_chosen_is_zero_at_step_zero_for_every_divergence():
    """Policy = reference: log(pi/pi_ref) = 0 on both sides, so rewards/chosen = beta * 0 = 0 (TRL's meaning), for
    f-DPO too (its link's value beta f'(1) = beta for reverse KL goes under implicit_rewards/chosen)."""
    for divergence in ("reverse_kl", "forward_kl", "js"):
        m = step_means(dpo(divergence=divergence).loss(TablePolicy(REF, REF), pairs()))
        assert m["rewards/chosen"] == 0.0 and m["rewards/rejected"] == 0.0, divergence
    m = step_means(dpo(divergence="forward_kl").loss(TablePolicy(REF, REF), pairs()))
    assert m["implicit_rewards/chosen"] == pytest.approx(-0.1, abs=1e-15)  # beta f'(1) = 0.1 (-1/1), float64
