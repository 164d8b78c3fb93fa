"""Theory oracles: the fixed point each conformance case is measured against (:mod:`prefzoo.lab.conformance`).

Every function here computes, independently of the plugins' code, where an algorithm should converge on a
:class:`~prefzoo.lab.tabular.TabularBandit` (Shape (P, K) float64 policies); the closed forms
``optimal_policy`` (pi*) and ``regularised_optimum`` (f-divergence optima) live in :mod:`prefzoo.objective`.

Theory (the target column of the conformance table). For one prompt with softmax logits theta, on-policy, an estimator k of
KL(pi || pi_ref) gives (``prefzoo/objective/kl.py``; Liu et al. 2025, arXiv:2510.01555; Schulman 2020):

* k in the reward (PPO, GRPO ``in_reward``): the expected update of theta_j is proportional to
  pi_j (R_j - E_pi R) with R_j = r_j - beta k(rho_j), rho = log pi/pi_ref; this is exactly the gradient
  of J_k(pi) = E_pi r - beta sum_y pi_ref f_k(pi/pi_ref) with f_k'(u) = k(log u). k1: f_k = u log u - u,
  the reverse KL: pi*. k2: f_k''(u) = log(u)/u < 0 for u < 1 — a NON-convex "divergence" that rewards
  pushing responses below their reference probability; responses that fall behind die (their penalty
  grows as they shrink) and dead ones stay dead: a path-dependent local maximum of J_k
  (:func:`in_reward_fixed_point`, numeric). k3: J_k = E r - beta (KL(pi||pi_ref) - KL(pi_ref||pi)) + const
  is unbounded above (the forward KL is +inf as soon as a response gets probability 0): no fixed point,
  the policy keeps collapsing for as long as it trains.
* k as a loss (GRPO ``as_loss``): the penalty's gradient is beta pi_j (k'(rho_j) - E_pi k'). k1: k' = 1,
  zero gradient, no regularisation (the policy climbs to the argmax of r); k2: k' = rho, the reverse-KL
  gradient (pi*); k3: k' = 1 - pi_ref/pi, the FORWARD-KL gradient: the fixed point is the maximiser of
  E r - beta KL(pi_ref || pi), :func:`prefzoo.objective.regularised_optimum` with ``forward_kl``.
* GRPO's advantage r_i - mean(r_1..r_G) includes r_i itself, so E[A_i grad log pi(y_i)] =
  (1 - 1/G) grad E_pi[r]: the reward's gradient is shrunk by (G-1)/G. "In reward" the penalty is shrunk
  with it (the fixed point is unchanged); "as loss" it is not, so as-loss GRPO regularises with
  beta_eff = beta G/(G-1) (with ``scale_rewards="none"``; with the paper's group std, by roughly
  beta sigma_pi(r) G/(G-1), a prompt- and policy-dependent beta).
* DPO on Bradley-Terry pairs P(y1 > y2) = sigmoid(r1 - r2) (scale 1, reward units): the f-DPO loss is
  the BT likelihood of the implicit reward beta f'(pi/pi_ref); its population minimiser makes
  beta f'(pi_j/pi_ref_j) = r_j - lambda, lambda fixed by normalisation: the maximiser of
  E r - beta D_f(pi || pi_ref), :func:`prefzoo.objective.regularised_optimum` (Wang et al. 2024, Thm 1)
  for every f, whatever pairs distribution covers all responses (the tabular model is well specified).
  For reverse KL that is pi*; for the others it is their own optimum, not pi*. (With a BT scale s the
  target is the same with r/s.)
* SimPO (single tokens, |y| = 1): with gamma = 0 its loss is DPO's with a uniform reference, so it lands
  on softmax(r / beta) (pi* of a uniform pi_ref: it ignores pi_ref). With a margin gamma > 0 there is no
  closed form; the target shown is the exact population minimiser of the SimPO loss under this pair
  distribution, found numerically (:func:`simpo_population_optimum`).
* The other pairwise losses (DPO's anchored and robust loss types, weighted sums with an NLL term, ORPO): no
  closed form in general; the target is the exact population minimiser of the loss under this pair
  distribution, written here from the paper's formula (not the plugin's code) and minimised numerically
  (:func:`pair_loss_population_optimum`). SFT on the chosen completions has one: the distribution of the
  chosen response, P(y_w = y) = sum_y' P(pair {y, y'}) sigmoid(r(y) - r(y')) (:func:`chosen_distribution`);
  ORPO with a small lambda lands near it.
* KTO on the pairs split into unpaired rows (chosen desirable, rejected undesirable): per prompt the desirable
  completions follow c(y) = P(y_w = y) and the undesirable ones u(y) = P(y_l = y), one of each per pair. With
  s = sigma(beta (rho - z0)) a row's loss is lambda_D (1 - s) if desirable and lambda_U s if undesirable (since
  1 - sigma(-x) = sigma(x)), so the population loss per prompt is sum_y [lambda_D c(y) - d(y) s(y)], d = lambda_D c -
  lambda_U u. A response with d(y) < 0 (rejected more often than chosen, weighted) lowers the loss as rho -> -inf:
  its probability goes to 0, and no interior minimiser exists. At that infimum z0 = max(0, E_{x, y'}[rho(x, y')])
  = 0 (the mismatched y' cover the responses whose rho is -inf), and the others maximise
  sum_{d > 0} d(y) sigma(beta log(pi(y)/pi_ref(y))) -- concave in pi for beta <= 1, so one maximiser
  (:func:`kto_population_optimum`). A run only heads there: the pushed-down responses' gradients fade like
  (pi/pi_ref)^beta.
* Best-of-n: the distribution of the best of n samples of pi_ref (ties split in proportion to pi_ref),
  :func:`best_of_n_policy`; the "learned" policy is the empirical distribution of best-of-n draws made
  with the tabular policy's own sampler and the table scorer. Its KL to pi_ref is at most
  log n - (n-1)/n, with equality only for continuous (all-distinct, fine-grained) rewards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from prefzoo.lab.tabular import TabularBandit
from prefzoo.objective import kl_estimate, optimal_policy, regularised_optimum

__all__ = ["argmax_policy", "in_reward_generator", "in_reward_fixed_point", "grpo_group_std_target",
           "best_of_n_policy", "simpo_population_optimum", "pair_weights", "chosen_distribution",
           "pair_loss_population_optimum", "kto_population_optimum", "maxrl_fixed_point"]


def argmax_policy(bandit: TabularBandit) -> Tensor:
    """pi_ref restricted to the responses of maximal reward (beta -> 0 limit), Shape (P, K) float64."""
    top = bandit.rewards == bandit.rewards.amax(-1, keepdim=True)
    p = torch.where(top, bandit.ref_probs, torch.zeros_like(bandit.ref_probs))
    return p / p.sum(-1, keepdim=True)


def in_reward_generator(estimator: str, u: Tensor) -> Tensor:
    """f_k(u), the generator whose derivative is the estimator: f_k'(u) = k(log u) (u = pi/pi_ref > 0).

        k1: f(u) = u log u - u                      (reverse KL up to a term constant on the simplex)
        k2: f(u) = u ((log u)^2 / 2 - log u + 1)    f''(u) = log(u) / u: CONCAVE for u < 1
        k3: f(u) = log u + (log u - 2) u            f''(u) = (u - 1) / u^2: CONCAVE for u < 1
    """
    log_u = torch.log(u)
    if estimator == "k1":
        return u * log_u - u
    if estimator == "k2":
        return u * (0.5 * log_u ** 2 - log_u + 1.0)
    if estimator == "k3":
        return log_u + (log_u - 2.0) * u
    raise ValueError(f"unknown estimator {estimator!r}; choose k1, k2 or k3")


def in_reward_fixed_point(bandit: TabularBandit, beta: float, estimator: str, steps: int = 3000,
                          lr: float = 0.05) -> Tensor:
    """Where "k in the reward" converges on a bandit, Shape (P, K) float64 (module docstring).

    On-policy, the expected update of "k in the reward" is exactly the gradient of
    J_k(pi) = E_pi[r] - beta sum_y pi_ref(y) f_k(pi(y)/pi_ref(y)) with f_k' = k o log
    (:func:`in_reward_generator`): d/dtheta_j of sum_y pi_ref f_k(u) is pi_j (k(rho_j) - E_pi k), the
    score-function gradient of E[k(rho)] with k held fixed. For k1 that is the reverse-KL objective: pi*,
    returned in closed form. For k2, f_k is concave below u = 1, so J_k is not concave: every response
    whose probability has fallen far enough below its reference one is pushed to 0 (dead responses are
    absorbing), and which ones die depends on the path. No closed form: this returns the local maximum
    that deterministic ascent from pi_ref reaches (Adam on the exact gradient
    g_j = pi_j (R_j - E_pi R), R = r - beta k(rho), float64; independent of the plugins' code).
    (For k3, J_k = E r - beta (KL(pi||pi_ref) - KL(pi_ref||pi)) + const is unbounded above — it grows
    without limit as any response's probability goes to 0 — so there is no fixed point to return.)

    Raises:
        ValueError: estimator k3 (no fixed point) or unknown.
    """
    ref, r = bandit.ref_probs, bandit.rewards
    if estimator == "k1":
        return optimal_policy(ref, r, beta)
    if estimator != "k2":
        raise ValueError(f"{estimator} in the reward has no fixed point to compute (see the docstring)")
    theta = torch.log(ref).clone()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    b1, b2 = 0.9, 0.999
    for t in range(1, steps + 1):
        pi = torch.softmax(theta, -1)
        shaped = r - beta * kl_estimate(theta - torch.log(ref) - torch.logsumexp(theta, -1, keepdim=True), estimator)
        grad = pi * (shaped - (pi * shaped).sum(-1, keepdim=True))  # ascent direction
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        step = lr * (1 - (t - 1) / steps)
        theta = theta + step * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + 1e-12)
    return torch.softmax(theta, -1)


def grpo_group_std_target(bandit: TabularBandit, beta: float, group: int, iters: int = 200) -> Tensor:
    """APPROXIMATE fixed point of GRPO with the paper's group-std scaling and k3 as a loss.

    Dividing the advantage by the group's reward std sigma acts (for large G) like a per-prompt
    beta_eff = beta sigma_pi(r) G/(G-1) in the k3-as-loss fixed point (forward-KL optimum); solved
    self-consistently by damped iteration. Approximate: it ignores the randomness of the group std.
    """
    ref, r = bandit.ref_probs, bandit.rewards
    pi = ref.clone()
    for _ in range(iters):
        mean = (pi * r).sum(-1, keepdim=True)
        sigma = ((pi * (r - mean) ** 2).sum(-1, keepdim=True)).sqrt().clamp(min=1e-6)
        beta_eff = beta * sigma * group / (group - 1)
        new = regularised_optimum(ref, r * beta / beta_eff, beta, "forward_kl")  # E r - b_eff D  ~  r b/b_eff
        pi = 0.5 * pi + 0.5 * new
    return pi


def maxrl_fixed_point(bandit: TabularBandit, beta: float, group: int = 4, eps: float = 1e-6, iters: int = 20000,
                      tol: float = 1e-11) -> Tensor:
    """EXACT population fixed point of GRPO with MaxRL's advantage and k2 as a loss on the single-token bed.

    One step's expected gradient in the logits z of a prompt, over groups (y_1..y_G) ~ pi iid, enumerated exactly
    (K^G outcomes), with m = mean of the group's rewards:

        A_i = (r(y_i) - m) / (m + eps)   (0 when m <= 0)        policy term:  E[(1/G) sum_i A_i (e_{y_i} - pi)]
        KL term (k2 = rho^2 / 2, rho = log pi/pi_ref, on the same samples):   beta E_{y~pi}[rho(y) (e_y - pi)]

    (grad_z log pi(y) = e_y - pi). The fixed point is where the two are equal; it is found by ascending the
    difference from pi_ref (a vector field, not a gradient: MaxRL's update is the gradient of no scalar here) until
    its largest component is below ``tol``. This is the random 1/m that the earlier self-consistent approximation
    (pi* at beta (G/(G-1)) E_pi[r]) ignored. ``beta`` is the run's beta: the group's (G-1)/G shrinkage is in the
    enumeration; ``eps`` the run's ``algo.advantage_eps`` (1e-6: MaxRL's own, the plugin's default). Shape (P, K)
    float64.

    Raises:
        RuntimeError: the iteration did not reach ``tol`` (the message gives the residual).
    """
    import itertools

    ref, r = bandit.ref_probs.double(), bandit.rewards.double()
    p, k = r.shape
    outcomes = torch.tensor(list(itertools.product(range(k), repeat=group)))  # (K^G, G)
    onehot = torch.nn.functional.one_hot(outcomes, k).double()  # (K^G, G, K)
    z = torch.log(ref).clone()
    for step in range(iters):
        pi = torch.softmax(z, -1)
        prob = pi[:, outcomes].prod(-1)  # (P, K^G): pi(y_1) ... pi(y_G)
        rew = r[:, outcomes]  # (P, K^G, G)
        m = rew.mean(-1, keepdim=True)
        adv = torch.where(m > 0, (rew - m) / (m + eps), torch.zeros_like(rew))
        # (1/G) sum_i A_i (e_{y_i} - pi) per outcome: (P, K^G, K)
        term = (adv[..., None] * (onehot[None] - pi[:, None, None, :])).mean(-2)
        policy = (prob[..., None] * term).sum(1)
        rho = torch.log(pi) - torch.log(ref)
        kl = pi * rho - pi * (pi * rho).sum(-1, keepdim=True)  # E_y[rho(y) (e_y - pi)]
        field = policy - beta * kl
        if float(field.abs().max()) < tol:
            return torch.softmax(z, -1)
        z = z + 2.0 * field
    raise RuntimeError(f"maxrl_fixed_point: no fixed point to {tol} after {iters} steps (residual "
                       f"{float(field.abs().max()):.2e})")


def best_of_n_policy(bandit: TabularBandit, n: int) -> Tensor:
    """Distribution of the highest-reward of n i.i.d. samples of pi_ref, Shape (P, K) float64.

    P(best has reward level v) = F(v)^n - F(v-)^n with F the reward CDF under pi_ref; responses that tie
    at a level share its probability in proportion to pi_ref (what "keep the first best sample" gives).
    """
    ref, r = bandit.ref_probs, bandit.rewards
    le = (r[..., None, :] <= r[..., :, None]).double()  # [p, j, k] = r_k <= r_j
    lt = (r[..., None, :] < r[..., :, None]).double()
    eq = le - lt
    f_le, f_lt = (le * ref[..., None, :]).sum(-1), (lt * ref[..., None, :]).sum(-1)
    level_mass = (eq * ref[..., None, :]).sum(-1)
    return ref / level_mass * (f_le ** n - f_lt ** n)


def simpo_population_optimum(bandit: TabularBandit, beta: float, gamma: float, steps: int = 200) -> Tensor:
    """Exact population minimiser of the single-token SimPO loss under this bed's pair distribution.

    E over (y1, y2) ~ pi_ref x pi_ref | y1 != y2 and BT labels of -log sigmoid(beta (log pi(y_w) -
    log pi(y_l)) - gamma), minimised over the logits in float64 by L-BFGS. (An independent computation:
    exact expectations instead of sampled pairs, and not the plugin's code.)
    """
    ref, r = bandit.ref_probs, bandit.rewards
    w = ref[..., :, None] * ref[..., None, :]
    w = w * (1 - torch.eye(r.shape[-1], dtype=w.dtype))
    w = w / w.sum((-1, -2), keepdim=True)
    p_win = torch.sigmoid(r[..., :, None] - r[..., None, :])  # [a, b]: P(a beats b)
    theta = torch.log(ref).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(theta, -1)
        margin = beta * (logp[..., :, None] - logp[..., None, :]) - gamma  # chosen a over rejected b
        loss = -(w * p_win * torch.nn.functional.logsigmoid(margin)).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return torch.softmax(theta.detach(), -1)


def pair_weights(bandit: TabularBandit) -> tuple[Tensor, Tensor]:
    """The bed's pair distribution: w[p, a, b] = P(y1 = a, y2 = b | y1 != y2) under pi_ref x pi_ref, and
    p_win[p, a, b] = sigmoid(r_a - r_b) = P(a is labelled chosen over b), Shape (P, K, K) float64 each."""
    ref, r = bandit.ref_probs, bandit.rewards
    w = ref[..., :, None] * ref[..., None, :]
    w = w * (1 - torch.eye(r.shape[-1], dtype=w.dtype))
    return w / w.sum((-1, -2), keepdim=True), torch.sigmoid(r[..., :, None] - r[..., None, :])


def chosen_distribution(bandit: TabularBandit) -> Tensor:
    """P(y_w = a) = 2 sum_b w[a, b] sigmoid(r_a - r_b), Shape (P, K) float64: where SFT on chosen completions
    converges (the minimiser of E[-log pi(y_w)] is the distribution of y_w)."""
    w, p_win = pair_weights(bandit)
    return 2 * (w * p_win).sum(-1)


def pair_loss_population_optimum(bandit: TabularBandit,
                                 loss: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
                                 steps: int = 300) -> Tensor:
    """Exact population minimiser of a per-pair loss on this bed, Shape (P, K) float64.

    ``loss(logp_w, logp_l, rho_w, rho_l)`` is the per-pair loss of single-token pairs from the policy's log-probs
    and log-ratios rho = log pi - log pi_ref (tensors broadcasting to (P, K, K): chosen a, rejected b). Its
    expectation over (y1, y2) ~ pi_ref x pi_ref | y1 != y2 with Bradley-Terry labels (:func:`pair_weights`) is
    minimised over the logits in float64 by L-BFGS, starting from pi_ref. (An independent computation: exact
    expectations instead of sampled pairs, the formula written by the caller from the paper, not the plugin's
    code.) For a loss whose infimum lies at the boundary of the simplex (some response with probability 0) it
    returns where L-BFGS stops.
    """
    ref = bandit.ref_probs
    w, p_win = pair_weights(bandit)
    theta = torch.log(ref).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(theta, -1)
        rho = logp - torch.log(ref)
        value = (w * p_win * loss(logp[..., :, None], logp[..., None, :], rho[..., :, None], rho[..., None, :])).sum()
        value.backward()
        return value

    opt.step(closure)
    return torch.softmax(theta.detach(), -1)


def kto_population_optimum(bandit: TabularBandit, beta: float, desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0, steps: int = 300) -> Tensor:
    """The infimum of KTO's population loss on this bed's pairs split into unpaired rows, Shape (P, K) float64.

    From the loss written per response (module docstring): d(y) = lambda_D c(y) - lambda_U u(y), with c and u the
    distributions of the chosen and the rejected response (:func:`pair_weights`); responses with d <= 0 get
    probability 0 (z0 is then 0), the others maximise sum_y d(y) sigma(beta log(pi(y) / pi_ref(y))) over the
    simplex, by L-BFGS in float64 on their logits (a concave problem for beta <= 1). An independent computation:
    exact expectations, the paper's formula, not the plugin's code.

    Raises:
        ValueError: beta is not in (0, 1] (the maximisation is then not concave: no unique target).
    """
    if not 0 < beta <= 1:
        raise ValueError(f"kto_population_optimum needs 0 < beta <= 1 (got {beta}): the target is unique only there")
    ref = bandit.ref_probs
    w, p_win = pair_weights(bandit)
    chosen, rejected = 2 * (w * p_win).sum(-1), 2 * (w * (1 - p_win)).sum(-1)
    d = desirable_weight * chosen - undesirable_weight * rejected
    keep = d > 0
    theta = torch.where(keep, torch.log(ref), torch.zeros_like(ref)).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([theta], lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(theta.masked_fill(~keep, float("-inf")), -1)
        rho = torch.where(keep, logp - torch.log(ref), torch.zeros_like(ref))
        value = -(torch.where(keep, d * torch.sigmoid(beta * rho), torch.zeros_like(ref))).sum()
        value.backward()
        return value

    opt.step(closure)
    return torch.softmax(theta.detach().masked_fill(~keep, float("-inf")), -1)
