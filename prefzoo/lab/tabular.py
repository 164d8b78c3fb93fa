"""A tabular test bed: the algorithm plugins, unchanged, on a policy that is a table of logits.

A *bandit* has P prompts and K responses per prompt, a known reference policy pi_ref (a table of logits)
and a known reward table r. Every response is a single token, so a :class:`~prefzoo.types.SequenceBatch`
row is ``prompt_ids (B, 1)`` = the prompt index and ``completion_ids (B, 1)`` = the response index, with all
masks True. On it the closed forms of :mod:`prefzoo.objective` are exact targets: pi* = pi_ref exp(r/beta)/Z
(:func:`~prefzoo.objective.optimal_policy`), the f-divergence optima
(:func:`~prefzoo.objective.regularised_optimum`), exact KL and total variation.

What is here:

* :class:`TabularBandit` — pi_ref logits and rewards, Shape (P, K) each; ``tile(n)`` stacks n independent
  copies (replicas) of the prompts, which is how the conformance suite runs several seeds in one
  vectorised run (the optimizers used are element-wise, so replicas do not interact; see
  :func:`train`).
* :class:`TabularPolicy` — an ``nn.Module`` with one trainable logits table (P, K) (and, for plugins with a
  value head, value tables V(x) and V(x, y)), implementing the :class:`~prefzoo.algos.base.Policy`
  protocol: ``logps`` (with temperature and entropy), ``ref_logps``, ``sample`` (grouped: rows
  [i*n, (i+1)*n) answer prompt i), ``values``; a ``reference`` attribute (the reference logits table, or
  None when the algorithm needs no reference) and a seeded ``torch.Generator``.
* :class:`TableScorer` — the scorer ``score(samples, prompts) -> rewards (B,)`` that reads the reward table.
* :class:`PromptSource` — the prompts of each online step.
* :func:`preference_pairs` / :class:`PairSource` — preference pairs sampled from pi_ref and labelled by a
  Bradley-Terry model of the reward, as :class:`~prefzoo.data.preference.PreferenceBatch` objects (what
  DPO and SimPO read from the real data pipeline); :func:`unpaired_rows` splits them into shuffled unpaired rows
  (KTO's :class:`~prefzoo.types.UnpairedBatch`).
* :func:`train` — a small driver that runs any registered plugin (dpo, simpo, grpo, ppo, rm) on the bed,
  step by step as :class:`prefzoo.training.loop.Trainer` does (make_experience for online plugins; the
  Trainer's own optimisation step, :func:`prefzoo.training.step.optimisation_step`: ``algo.epochs`` passes of
  ``algo.num_minibatches`` optimizer steps; ``algo.after_step``).

Bradley-Terry scale. A pair (y1, y2) is labelled y1 > y2 with probability sigmoid((r(y1) - r(y2)) / s),
``s = bt_scale`` in reward units (default 1). DPO's derivation assumes s = 1 in the units of the reward it
regularises; with another s, DPO on these pairs targets pi_ref exp(r / (beta s)) / Z.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from prefzoo.algos.base import Algorithm

from prefzoo.errors import PrefzooError
from prefzoo.types import Batch, PromptBatch, SamplingParams, SequenceBatch, UnpairedBatch
from prefzoo.objective import TokenLogits, categorical_kl, token_entropy
from prefzoo.training.step import mean_metrics, optimisation_step

__all__ = ["TabularError", "TabularBandit", "TabularPolicy", "TableScorer", "PromptSource", "PairSource",
           "preference_pairs", "unpaired_rows", "TrainSettings", "train", "total_variation", "kl_divergence"]


class TabularError(PrefzooError, ValueError):
    """A batch or setting the tabular test bed cannot handle; the message says what to change."""


# ----------------------------------------------------------------------------------------------- bandit
@dataclass
class TabularBandit:
    """P prompts x K single-token responses with a known reference policy and reward.

    Attributes:
        ref_logits: Shape (P, K) float64, logits of pi_ref(y | x) (softmax over K).
        rewards: Shape (P, K) float64, r(x, y) in reward units.
        name: a label for tables.
    """

    ref_logits: Tensor
    rewards: Tensor
    name: str = "bandit"

    def __post_init__(self) -> None:
        self.ref_logits = torch.as_tensor(self.ref_logits, dtype=torch.float64)
        self.rewards = torch.as_tensor(self.rewards, dtype=torch.float64)
        if self.ref_logits.ndim != 2 or self.ref_logits.shape != self.rewards.shape:
            raise TabularError(f"ref_logits {tuple(self.ref_logits.shape)} and rewards {tuple(self.rewards.shape)} "
                               "must both be (P, K): one row per prompt, one column per response")
        if not bool(torch.isfinite(self.ref_logits).all() and torch.isfinite(self.rewards).all()):
            raise TabularError("ref_logits and rewards must be finite (give every response some reference mass)")

    @property
    def num_prompts(self) -> int:
        return self.ref_logits.shape[0]

    @property
    def num_responses(self) -> int:
        return self.ref_logits.shape[1]

    @property
    def ref_probs(self) -> Tensor:
        """pi_ref, Shape (P, K) float64."""
        return torch.softmax(self.ref_logits, dim=-1)

    def tile(self, replicas: int) -> "TabularBandit":
        """``replicas`` stacked copies: prompt p of replica s is row s * P + p. Shape (replicas * P, K)."""
        return replace(self, ref_logits=self.ref_logits.repeat(replicas, 1), rewards=self.rewards.repeat(replicas, 1))


def total_variation(p: Tensor, q: Tensor) -> Tensor:
    """TV(p, q) = 1/2 sum_y |p(y) - q(y)|. Shape (..., K) -> (...). Units: probability (0..1)."""
    return 0.5 * (p - q).abs().sum(-1)


def kl_divergence(p: Tensor, q: Tensor) -> Tensor:
    """KL(p || q) = sum_y p log(p / q) between probability tables, Shape (..., K) -> (...), nats.

    Computed by :func:`prefzoo.objective.categorical_kl` on log-probabilities (zero-probability entries of p
    contribute 0; q must be > 0 where p > 0)."""
    return categorical_kl(torch.log(p.double()), torch.log(q.double()))


# ----------------------------------------------------------------------------------------------- policy
class TabularPolicy(nn.Module):
    """A policy pi_theta(y | x) = softmax(logits[x])_y over a (P, K) table, behind the Policy protocol.

    Args:
        ref_logits: Shape (P, K), the reference policy's logits (also the starting point by default).
        init_logits: Shape (P, K) starting logits (default: ``ref_logits``, i.e. start at pi_ref).
        with_reference: expose ``reference`` and ``ref_logps`` (False mirrors a run whose algorithm needs
            no reference: ``ref_logps`` then raises, so a plugin that claims to be reference-free is checked).
        value_head: add trainable value tables (``values``): V(x), Shape (P,), the state before the response
            (PPO), and V(x, y), Shape (P, K), the state after it (read by the reward-model plugin).
        seed: seeds ``generator`` (all sampling goes through it).
        teacher_logits: Shape (P, K), a frozen teacher's logits (``algo=distill``: ``teacher_logps`` and
            ``token_logits(teacher=True)``), or None.

    Batches: ``prompt_ids (B, L)`` left-padded, whose LAST column is the prompt index (0..P-1);
    ``completion_ids (B, 1)``, the response index (0..K-1). Log-probs are float32.
    """

    tractable_logps = True  # the Policy interface: per-token log-probs exist
    analytic_kl = None  # ... and the KL is measured, not known in closed form

    def __init__(self, ref_logits: Tensor, init_logits: Tensor | None = None, with_reference: bool = True,
                 value_head: bool = False, seed: int = 0, teacher_logits: Tensor | None = None):
        super().__init__()
        ref_logits = torch.as_tensor(ref_logits).float()
        if ref_logits.ndim != 2:
            raise TabularError(f"ref_logits must be (P, K), got shape {tuple(ref_logits.shape)}")
        init = ref_logits if init_logits is None else torch.as_tensor(init_logits).float()
        if init.shape != ref_logits.shape:
            raise TabularError(f"init_logits {tuple(init.shape)} must have the shape of ref_logits "
                               f"{tuple(ref_logits.shape)}")
        self.logits = nn.Parameter(init.clone())
        self.register_buffer("ref_table", ref_logits.clone())
        self.reference: Tensor | None = self.ref_table if with_reference else None
        self.value_table = nn.Parameter(torch.zeros(ref_logits.shape[0])) if value_head else None
        self.terminal_table = nn.Parameter(torch.zeros_like(ref_logits)) if value_head else None
        self.value_model = None  # the loop's name for a separate value network; the tabular one is built in
        self.generator = torch.Generator().manual_seed(seed)
        self.pad_id = 0
        if teacher_logits is not None and tuple(teacher_logits.shape) != tuple(ref_logits.shape):
            raise TabularError(f"teacher_logits {tuple(teacher_logits.shape)} must have the shape of ref_logits "
                               f"{tuple(ref_logits.shape)}")
        self.teacher: Tensor | None = None if teacher_logits is None else torch.as_tensor(teacher_logits).float().clone()

    @property
    def num_prompts(self) -> int:
        return self.logits.shape[0]

    @property
    def num_responses(self) -> int:
        return self.logits.shape[1]

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def probs(self) -> Tensor:
        """The current policy table pi_theta, Shape (P, K) float64, detached."""
        return torch.softmax(self.logits.detach().double(), dim=-1)

    def _rows(self, prompt_ids: Tensor) -> Tensor:
        if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
            raise TabularError(f"prompt_ids must be (B, L) with the prompt index in the last column, got shape "
                               f"{tuple(prompt_ids.shape)}")
        rows = prompt_ids[:, -1].long()
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= self.num_prompts):
            raise TabularError(f"prompt index out of range [0, {self.num_prompts}): got {int(rows.min())}.."
                               f"{int(rows.max())}; prompt_ids[:, -1] must hold the prompt's row in the table")
        return rows

    def _check(self, batch: SequenceBatch) -> Tensor:
        if batch.completion_ids.ndim != 2 or batch.completion_ids.shape[1] != 1:
            raise TabularError(f"the tabular policy has single-token responses: completion_ids must be (B, 1), got "
                               f"{tuple(batch.completion_ids.shape)}")
        ids = batch.completion_ids[:, 0]
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.num_responses):
            raise TabularError(f"response index out of range [0, {self.num_responses}): completion_ids hold "
                               f"{int(ids.min())}..{int(ids.max())}")
        return self._rows(batch.prompt_ids)

    @staticmethod
    def _gather(table: Tensor, rows: Tensor, batch: SequenceBatch, temperature: float) -> Tensor:
        if not temperature > 0:
            raise TabularError(f"temperature must be > 0, got {temperature}")
        log_table = torch.log_softmax(table.float() / temperature, dim=-1)  # (P, K), float32
        logps = log_table[rows, batch.completion_ids[:, 0].long()][:, None]  # (B, 1)
        return logps.masked_fill(~batch.completion_mask, 0.0)

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        """log pi_theta of each completion token, Shape (B, 1) float32 (0 where masked), with grad; and the
        entropy of pi_theta(. | x) in nats, Shape (B, 1), detached, when ``with_entropy``."""
        rows = self._check(batch)
        logps = self._gather(self.logits, rows, batch, temperature)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                per_prompt = token_entropy(self.logits.detach()[None], temperature)[0]  # (P,)
                entropy = per_prompt[rows][:, None].masked_fill(~batch.completion_mask, 0.0)
        return logps, entropy

    @torch.no_grad()
    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """log pi_ref of each completion token, Shape (B, 1) float32, no grad.

        Raises:
            TabularError: the policy was built without a reference (``with_reference=False``).
        """
        if self.reference is None:
            raise TabularError("this tabular policy has no reference (with_reference=False): the algorithm "
                               "declared it needs none, yet asked for reference log-probs")
        return self._gather(self.reference, self._check(batch), batch, temperature)

    def _teacher_table(self) -> Tensor:
        if self.teacher is None:
            raise TabularError("this tabular policy has no teacher: build it with teacher_logits=... (algo=distill)")
        return self.teacher

    @torch.no_grad()
    def teacher_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """log pi_T of each completion token, Shape (B, 1) float32, no grad (``teacher_logits``)."""
        return self._gather(self._teacher_table(), self._check(batch), batch, temperature)

    def token_logits(self, batch: SequenceBatch, teacher: bool = False) -> TokenLogits:
        """The logits over the K responses at each counted position, in the linear form of a language model: states
        = the one-hot of the row's prompt (N, P), weight = the table transposed (K, P), so logits = table[prompt] (with
        the gradient into the policy's table; the teacher's without)."""
        rows = self._check(batch)[batch.completion_mask[:, 0]]
        table = self._teacher_table() if teacher else self.logits
        states = torch.nn.functional.one_hot(rows, self.num_prompts).to(table.dtype)
        return TokenLogits(states, table.detach().t() if teacher else table.t())

    def values(self, batch: SequenceBatch) -> Tensor:
        """Values of the state before each completion position, Shape (B, C) float32 (0 where masked), with grad.

        Column 0 is V(x) (``value_table``, the state before the response: PPO's value). A second column, if
        present, is the state after the response, V(x, y) (``terminal_table``): the reward model plugin
        (``algo=rm``) appends a filler column and reads it there. C > 2 is an error (responses are one token).

        Raises:
            TabularError: built without ``value_head=True``; more than 2 columns; indices out of range.
        """
        if self.value_table is None:
            raise TabularError("this tabular policy has no value head; build it with value_head=True (PPO, rm)")
        c = batch.completion_ids.shape[1] if batch.completion_ids.ndim == 2 else 0
        if c not in (1, 2):
            raise TabularError(f"values: completion_ids must be (B, 1), or (B, 2) with a terminal filler column; "
                               f"got {tuple(batch.completion_ids.shape)}")
        rows = self._check(SequenceBatch(batch.prompt_ids, batch.prompt_mask, batch.completion_ids[:, :1],
                                         batch.completion_mask[:, :1]))
        cols = [self.value_table[rows]]
        if c == 2:
            cols.append(self.terminal_table[rows, batch.completion_ids[:, 0].long()])
        return torch.stack(cols, dim=1).masked_fill(~batch.completion_mask, 0.0)

    def logps_and_values(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
        """:meth:`logps` and :meth:`values` (tables: nothing to share)."""
        return (*self.logps(batch, temperature, with_entropy), self.values(batch))

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` responses per prompt, grouped: rows [i*n, (i+1)*n) answer prompt i.

        Sampling follows ``params``: softmax(logits / temperature), restricted to the top-p nucleus, or the
        argmax when ``greedy``; all randomness comes from ``self.generator``.
        """
        if num_samples < 1:
            raise TabularError(f"num_samples must be >= 1, got {num_samples}")
        rows = self._rows(prompts.prompt_ids)
        n = int(num_samples)
        if params.greedy:
            ids = self.logits[rows].argmax(-1, keepdim=True).expand(-1, n)
        else:
            if not params.temperature > 0:
                raise TabularError(f"sampling temperature must be > 0, got {params.temperature} (use greedy=True)")
            probs = torch.softmax(self.logits[rows].float() / params.temperature, dim=-1)
            if params.top_p < 1.0:
                probs = _nucleus(probs, params.top_p)
            ids = torch.multinomial(probs, n, replacement=True, generator=self.generator)  # (B_prompts, n)
        b = len(rows)
        return SequenceBatch(
            prompt_ids=prompts.prompt_ids.repeat_interleave(n, dim=0),
            prompt_mask=prompts.prompt_mask.repeat_interleave(n, dim=0),
            completion_ids=ids.reshape(b * n, 1).long(),
            completion_mask=torch.ones(b * n, 1, dtype=torch.bool),
            prompt_index=torch.arange(b).repeat_interleave(n),
            truncated=torch.zeros(b * n, dtype=torch.bool),
        )


def _nucleus(probs: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely responses whose mass reaches ``top_p``; renormalise."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each entry
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


# ----------------------------------------------------------------------------------------------- data
class TableScorer:
    """``score(samples, prompts) -> rewards (B,)`` float32: r(x, y) read from a (P, K) reward table."""

    def __init__(self, rewards: Tensor):
        self.rewards = torch.as_tensor(rewards).float()
        self.last_metrics: dict[str, float] = {}

    def __call__(self, samples: SequenceBatch, prompts: PromptBatch | None = None) -> Tensor:
        rows = samples.prompt_ids[:, -1].long()
        return self.rewards[rows, samples.completion_ids[:, 0].long()]


def prompt_batch(rows: Tensor) -> PromptBatch:
    """A PromptBatch whose prompts are the table rows ``rows`` (Shape (B,) long)."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    return PromptBatch(prompt_ids=rows[:, None].clone(), prompt_mask=torch.ones(len(rows), 1, dtype=torch.bool))


@dataclass
class PromptSource:
    """The prompts of each online step.

    Every step gives each of the ``num_prompts`` prompts ``repeats`` times (so each prompt carries the same
    weight, and a step samples ``num_prompts * repeats * group`` responses); with ``batch_size`` set, it
    gives ``batch_size`` prompts drawn uniformly with replacement instead (``generator`` seeds the draw).
    """

    num_prompts: int
    repeats: int = 1
    batch_size: int | None = None
    generator: torch.Generator | None = None

    def next(self) -> PromptBatch:
        if self.batch_size is None:
            rows = torch.arange(self.num_prompts).repeat(self.repeats)
        else:
            rows = torch.randint(self.num_prompts, (self.batch_size,), generator=self.generator)
        return prompt_batch(rows)


def preference_pairs(bandit: TabularBandit, pairs_per_prompt: int, generator: torch.Generator,
                     bt_scale: float = 1.0) -> "PreferenceBatch":  # noqa: F821
    """Preference pairs sampled from pi_ref and labelled by a Bradley-Terry model of the reward.

    For each prompt x, ``pairs_per_prompt`` pairs (y1, y2) are drawn i.i.d. from pi_ref(.|x) x pi_ref(.|x)
    conditioned on y1 != y2 (real datasets never pair a response with itself, and such a pair carries no
    information), and y1 is labelled chosen with probability

        P(y1 > y2 | x) = sigmoid((r(x, y1) - r(x, y2)) / bt_scale)          (Bradley & Terry 1952)

    Returns:
        a :class:`prefzoo.data.preference.PreferenceBatch` of P * pairs_per_prompt rows (prompt-major),
        with ``index`` = row number and no precomputed reference log-probs.

    Raises:
        TabularError: fewer than two responses with reference mass; bt_scale <= 0.
    """
    from prefzoo.data.preference import PreferenceBatch  # imported here: the datasets library is slow to load

    if not bt_scale > 0:
        raise TabularError(f"bt_scale must be > 0 (reward units per logit of preference), got {bt_scale}")
    probs = bandit.ref_probs.float()
    if bool((probs.max(-1).values > 1 - 1e-6).any()):
        raise TabularError("a prompt has (almost) all its reference mass on one response: no distinct pairs")
    p, n = bandit.num_prompts, int(pairs_per_prompt)
    first = torch.multinomial(probs, n, replacement=True, generator=generator)
    second = torch.multinomial(probs, n, replacement=True, generator=generator)
    same = first == second
    while bool(same.any()):  # rejection sampling: exactly the distribution conditioned on y1 != y2
        redo = same.nonzero(as_tuple=True)
        first[redo] = torch.multinomial(probs[redo[0]], 1, generator=generator)[:, 0]
        second[redo] = torch.multinomial(probs[redo[0]], 1, generator=generator)[:, 0]
        same = first == second
    rows = torch.arange(p)[:, None].expand(p, n)
    r1, r2 = bandit.rewards[rows, first], bandit.rewards[rows, second]
    p_first = torch.sigmoid((r1 - r2) / bt_scale)
    first_wins = torch.rand(p, n, generator=generator, dtype=torch.float64) < p_first
    chosen = torch.where(first_wins, first, second).reshape(-1, 1)
    rejected = torch.where(first_wins, second, first).reshape(-1, 1)
    prompt_ids = rows.reshape(-1, 1).clone()
    ones = torch.ones(p * n, 1, dtype=torch.bool)
    return PreferenceBatch(
        chosen=SequenceBatch(prompt_ids, ones, chosen, ones.clone()),
        rejected=SequenceBatch(prompt_ids.clone(), ones.clone(), rejected, ones.clone()),
        index=torch.arange(p * n),
    )


def unpaired_rows(pairs, generator: torch.Generator) -> UnpairedBatch:
    """Each pair as two unpaired rows -- chosen desirable, rejected undesirable, as the real pipeline splits pairs
    (:func:`prefzoo.data.unpaired.split_pairs`) -- in a random order (``generator``), so that neighbouring rows are
    independent draws, as in the real loop's shuffled batches (KTO pairs each row with the next row's completion).

    Shape: B pairs -> 2B rows; ``index`` = the row's place before shuffling (2i: pair i's chosen, 2i + 1: its rejected).
    """
    b = len(pairs)
    stack = lambda x, y: torch.stack([x, y], dim=1).reshape(2 * b, *x.shape[1:])  # noqa: E731 (row 2i, 2i + 1)
    order = torch.randperm(2 * b, generator=generator)
    c, r = pairs.chosen, pairs.rejected
    rows = UnpairedBatch(stack(c.prompt_ids, r.prompt_ids), stack(c.prompt_mask, r.prompt_mask),
                         stack(c.completion_ids, r.completion_ids), stack(c.completion_mask, r.completion_mask),
                         labels=torch.arange(2 * b) % 2 == 0, index=torch.arange(2 * b))
    return rows.select(order)


@dataclass
class PairSource:
    """The preference pairs of each offline step: the whole dataset (``batch_size=None``: full-batch
    training) or ``batch_size`` pairs drawn without replacement, reshuffled every epoch."""

    pairs: Batch
    batch_size: int | None = None
    generator: torch.Generator | None = None
    _order: Tensor | None = field(default=None, repr=False)
    _pos: int = field(default=0, repr=False)

    def next(self) -> Batch:
        if self.batch_size is None:
            return self.pairs
        n = len(self.pairs)
        if self._order is None or self._pos + self.batch_size > n:
            self._order, self._pos = torch.randperm(n, generator=self.generator), 0
        idx = self._order[self._pos:self._pos + self.batch_size]
        self._pos += self.batch_size
        return self.pairs.select(idx)


# ----------------------------------------------------------------------------------------------- driver
#: how online plugins sample on the bed: one response token per completion, at temperature 1
BED_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=1)


@dataclass
class TrainSettings:
    """How :func:`train` optimises.

    ``lr`` decays linearly to ``lr * final_lr_fraction`` over the run (``lr_schedule="linear"``) or stays
    constant. ``optimizer``: ``adam`` (torch.optim.Adam, element-wise, so tiled replicas stay independent)
    or ``sgd``. ``micro_batch_size``: rows per forward/backward (None: the whole mini-batch at once).
    ``max_grad_norm``: clip (None: no clipping; clipping couples tiled replicas, so the conformance suite
    leaves it off). How online plugins sample is the plugin's own ``sampling`` (set when it is built:
    :data:`BED_SAMPLING`, one token at temperature 1, in :func:`prefzoo.lab.runner.build_algorithm`).
    """

    steps: int = 300
    lr: float = 0.05
    optimizer: str = "adam"
    lr_schedule: str = "linear"
    final_lr_fraction: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    micro_batch_size: int | None = None
    max_grad_norm: float | None = None


def make_optimizer(params, settings: TrainSettings) -> tuple[torch.optim.Optimizer, object]:
    """The optimizer and its per-optimizer-step learning-rate schedule (see :class:`TrainSettings`)."""
    if settings.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=settings.lr, betas=settings.betas)
    elif settings.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=settings.lr)
    else:
        raise TabularError(f"optimizer={settings.optimizer!r}; choose adam or sgd")
    if settings.lr_schedule not in ("linear", "constant"):
        raise TabularError(f"lr_schedule={settings.lr_schedule!r}; choose linear or constant")
    return opt, None if settings.lr_schedule == "constant" else _linear(opt, settings)


def _linear(opt, settings: TrainSettings):
    drop = 1.0 - settings.final_lr_fraction
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - drop * min(1.0, s / max(1, settings.steps)))


def train(algo: Algorithm, policy: TabularPolicy, data: PromptSource | PairSource, settings: TrainSettings,
          scorer: Callable | None = None, callback: Callable[[int, dict], None] | None = None) -> list[dict]:
    """Run ``settings.steps`` training steps of ``algo`` on ``policy``, the way the training loop does.

    One step (as :meth:`prefzoo.training.loop.Trainer.train_step`): the next batch — ``data.next()``
    prompts turned into experience by ``algo.make_experience(policy, prompts, scorer)`` for
    online plugins, ``data.next()`` preference pairs for offline ones; then the Trainer's optimisation step,
    :func:`prefzoo.training.step.optimisation_step`: the declared ``epochs`` passes, each split into
    ``num_minibatches`` mini-batches (shuffled with the policy's generator when more than one), each
    one optimizer step; then ``algo.after_step``. The learning-rate schedule counts optimizer steps
    (``steps * epochs * num_minibatches``).

    Differences from the Trainer, all on the optimiser side: Adam or SGD instead of AdamW with warm-up, no
    gradient clipping unless ``max_grad_norm`` is set, and the scorer is the reward table (no text).

    Returns:
        one metrics dict per step (the plugin's metrics, ``lr``, ``beta``, and ``grad_norm`` if clipping).

    Raises:
        TabularError: an online plugin without a scorer or PromptSource; an offline one without pairs.
    """
    d = algo.declaration
    if d.online and (scorer is None or not isinstance(data, PromptSource)):
        raise TabularError(f"{algo.name} is online: pass a PromptSource and a scorer (e.g. TableScorer)")
    if not d.online and not isinstance(data, PairSource):
        raise TabularError(f"{algo.name} is offline: pass a PairSource of preference pairs")
    params = [p for p in policy.parameters() if p.requires_grad]
    per_step = d.epochs * d.num_minibatches
    opt, sched = make_optimizer(params, replace(settings, steps=settings.steps * per_step))
    shuffle = lambda rows: torch.randperm(rows, generator=policy.generator).tolist()  # noqa: E731
    history = []
    for step in range(settings.steps):
        if d.online:
            batch, metrics = algo.make_experience(policy, data.next(), scorer)
        else:
            batch, metrics = data.next(), {}
        out = mean_metrics(optimisation_step(algo, policy, batch, opt, sched, params, settings.micro_batch_size,
                                             max_grad_norm=settings.max_grad_norm, permutation=shuffle))
        out.update(metrics)
        out.update(algo.after_step(out, len(batch)))
        out["beta"] = algo.beta
        history.append(out)
        if callback is not None:
            callback(step, out)
    return history
