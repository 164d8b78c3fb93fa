"""A causal language model (with its LoRA adapter, reference and optional value head) as a :class:`Policy`.

This is where a transformer meets the plugin interface of :mod:`prefzoo.algos.base`: plugins ask for
per-token log-probs of completion tokens, reference log-probs, values and samples, and never see the
model class.

Layout: a row is ``[left-padded prompt | right-padded completion]``. Position ids count real tokens
only, so the same sequence gives the same log-probs whatever its padding. Only the positions that
predict completion tokens go through the output layer, never the prompt.

Two ways to the log-probs, equal up to float rounding (``tests/perf/test_policy_fast.py``):

* plain (:func:`completion_logits`): the model's own forward with ``logits_to_keep = C + 1``, then
  :func:`prefzoo.objective.token_logps` on the (B, C, V) logits;
* fused (the default, ``fused_logps=True``): the transformer body only, to the final hidden states; the
  positions that count (completion tokens, not padding) are gathered to (N, d) and
  :func:`prefzoo.objective.linear_token_logps` applies the output layer, log-softmax and gather chunk by chunk,
  recomputing each chunk's logits in the backward, so the (B, C, V) float32 logits never exist for the whole
  batch; the entropy, when asked, comes from the same pass. And rows that share a prompt (DPO's chosen and
  rejected, a GRPO group) run it ONCE (``share_prompts=True``): the unique prompts go through the body with a
  KV cache, the cache is indexed out to the rows (gradients flow back through it), and the completions run on
  top. With SmolLM2's ~100-token prompts and ~120-token completions that is 23% fewer tokens per DPO pass.
  The fused path is used when the model's logits are its output layer applied to the body's last hidden
  state, which is checked once per model on a short input (it is not, e.g., for logit soft-capping models);
  otherwise, and for data-parallel forwards (which must go through the DDP wrapper), the plain path runs.

Padding-free (``padding_free=True``, ``model.fast.padding_free`` for offline plugins): either path runs the batch
as ONE packed row of its real tokens (:mod:`prefzoo.models.packing`: rows sharing a prompt keep it once, each row
attends only to its own tokens), then gathers the positions that predict completion tokens; the (B, T) outputs are
the padded ones up to float rounding (``tests/perf/test_packing.py``).

The reference pass runs under ``torch.inference_mode`` (no autograd bookkeeping at all), in the same layout.
Sampling goes through the policy's rollout engine (:mod:`prefzoo.rollout.engine`): prefzoo's decode loop by default,
on a merged-weights copy of a LoRA policy (:mod:`prefzoo.models.merged`, ``model.fast.merged_rollout``); or vLLM.
``compute_dtype`` (e.g. ``torch.bfloat16``) runs the forwards under CPU/GPU autocast; with bf16 base weights
(``model.dtype=bfloat16``) the forwards run in bf16 as they are. Either way log-probs stay float32
(:mod:`prefzoo.models.precision`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import contextlib
import logging

import torch
from torch import Tensor, nn

from prefzoo.types import PromptBatch, RolloutEngine, SamplingParams, SequenceBatch, position_ids_from_mask
from prefzoo.errors import ModelError
from prefzoo.models.body import body_and_head, completion_hidden, logits_are_head_of_body
from prefzoo.models.reference import Reference
from prefzoo.models.packing import pack_batch, packed_forward_kwargs, packed_states, packing_mode
from prefzoo.objective import TokenLogits, linear_token_logps, support_log_mass, token_entropy, token_logps
from prefzoo.objective.linear_logps import LOW_PRECISION

log = logging.getLogger(__name__)


def completion_logits(model: nn.Module, batch: SequenceBatch) -> Tensor:
    """Logits at the positions that predict each completion token. Shape (B, C, V), the model's dtype.

    ``model`` is the causal LM, or any callable taking its keyword arguments (e.g. a data-parallel wrapper)."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = batch.attention_mask()  # the environment's tokens too (multi-turn): part of the state
    c = batch.completion_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                use_cache=False, logits_to_keep=c + 1)
    return out.logits[:, :-1]


def packed_completion_logits(model, batch: SequenceBatch, mode: str | None, share_prompts: bool = True) -> Tensor | None:
    """Logits at the positions that predict each counted completion token, from ONE packed forward
    (:mod:`prefzoo.models.packing`; ``logits_to_keep`` = those positions). Shape (n, V), in the order of
    ``batch.completion_mask``'s True entries; None when ``mode`` is None or the batch has no packed layout.

    ``model`` is the causal LM or a callable taking its keyword arguments; ``mode`` the LM's
    :func:`~prefzoo.models.packing.packing_mode`."""
    packed = pack_batch(batch, share_prompts and mode == "segments") if mode else None
    if packed is None:
        return None
    return model(**packed_forward_kwargs(packed, mode), logits_to_keep=packed.source).logits[0]


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """``module`` in eval mode (dropout off) for the duration; its previous mode restored after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


class CausalLMPolicy:
    """Policy interface over a Hugging Face causal LM.

    Args:
        model: the trainable model (a peft ``PeftModel`` under LoRA).
        tokenizer: its tokenizer (pad and EOS ids come from it).
        reference: how pi_ref is computed, or None when the algorithm needs no reference.
        value_model: a module mapping a :class:`SequenceBatch` to per-token values (PPO), or None.
        logits_chunk_size: positions per chunk when turning logits into log-probs (bounds float32 copies);
            None: one chunk.
        generator: the random source of :meth:`sample` for prompts without a :data:`ROLLOUT_SEED_COLUMN`.
        fused_logps: log-probs from the final hidden states with the output layer chunked (module docstring);
            False: always the plain path.
        share_prompts: (fused path) rows with the same prompt run it once.
        head_chunk_size: (fused path) positions per chunk of the output layer.
        compute_dtype: run forwards under autocast to this dtype (e.g. ``torch.bfloat16``); None: the weights'.
        engine: what draws the samples (:class:`~prefzoo.types.RolloutEngine`: the run's engine stack, built once by
            :func:`prefzoo.training.setup.build_engine`); None: a policy that never samples (:meth:`sample` raises).
        train_forward: data parallelism: the wrapper (DDP over the trainable modules, or them sharded: see
            :mod:`prefzoo.training.distributed`) called as ``train_forward("policy", **model_kwargs)`` or
            ``train_forward("value", batch)``; None: one process.
        padding_free: log-probs (policy and reference) from one packed pass of the batch's real tokens
            (:mod:`prefzoo.models.packing`), where the model's attention can run it and the batch has the layout;
            else padded.
        teacher: a frozen teacher (``algo=distill``: :class:`~prefzoo.types.DistillationPolicy`), run as the reference
            is (:class:`~prefzoo.models.reference.Reference`), or None.

    Data parallelism: forward passes that carry gradients go through ``train_forward``, so gradients are all-reduced
    in the backward; passes without gradients (sampling, old/reference log-probs, evaluation) use the plain model and
    involve no other process.
    """

    #: per-token log-probs exist (a best-of-n procedure has none); the evaluation reads it
    tractable_logps = True
    #: KL(pi || pi_ref) in closed form, nats per sequence, or None (then it is estimated from samples)
    analytic_kl = None

    def __init__(self, model: nn.Module, tokenizer, reference: Reference | None = None,
                 value_model: nn.Module | None = None, logits_chunk_size: int | None = 64,
                 generator: torch.Generator | None = None, fused_logps: bool = True, share_prompts: bool = True,
                 head_chunk_size: int = 256, compute_dtype: torch.dtype | None = None,
                 engine: RolloutEngine | None = None, padding_free: bool = False, teacher: Reference | None = None,
                 train_forward: Callable | None = None):
        self.model = model
        self.teacher = teacher
        self.padding_free = padding_free
        self.fused_logps = fused_logps
        self.share_prompts = share_prompts
        self.head_chunk_size = head_chunk_size
        self.compute_dtype = compute_dtype
        self._fused_ok: dict[int, bool] = {}  # id(module) -> whether its logits are head(body(...))
        self.tokenizer = tokenizer
        self.reference = reference
        self.value_model = value_model
        self.logits_chunk_size = logits_chunk_size
        self.generator = generator
        self.train_forward = train_forward
        self.pad_id = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.engine = engine

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        """The autocast context of ``compute_dtype`` (a no-op context when None)."""
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def fused_parts(self, module: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
        """(body, output layer) of ``module`` if the fused path computes its logits, else None (checked once)."""
        parts = body_and_head(module) if self.fused_logps else None
        if parts is None:
            return None
        key = id(module)
        if key not in self._fused_ok:
            self._fused_ok[key] = logits_are_head_of_body(module, *parts)
            if not self._fused_ok[key]:
                log.warning("%s: its logits are not the output layer applied to the last hidden state (e.g. logit "
                            "soft-capping); using the plain log-prob path.", type(module).__name__)
        return parts if self._fused_ok[key] else None

    def head_matmul_dtype(self, head: nn.Linear) -> torch.dtype | None:
        """The dtype of the fused output layer's matmuls: ``compute_dtype`` when it is bf16/fp16 (autocast), else the
        output layer's own dtype when bf16/fp16 (``model.dtype=bfloat16``), else None (float32). The log-probs stay
        float32 either way (:func:`prefzoo.objective.linear_token_logps`, ``matmul_dtype``: logits relative to the
        label's, within a derived bound of float32 logits)."""
        if self.compute_dtype in LOW_PRECISION:
            return self.compute_dtype
        return head.weight.dtype if head.weight.dtype in LOW_PRECISION else None

    def _states(self, body: nn.Module, batch: SequenceBatch) -> Tensor:
        """The body's final hidden states at the counted positions (those predicting completion tokens), (N, d)."""
        with self.autocast():
            states = packed_states(body, batch, self.share_prompts) if self.padding_free else None
            if states is None:
                states = completion_hidden(body, batch, self.share_prompts)[batch.completion_mask]
        return states

    def _fused(self, parts, batch: SequenceBatch, temperature: float, with_entropy: bool,
               states: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        body, head = parts
        mask = batch.completion_mask
        states = self._states(body, batch) if states is None else states
        chunk = self.head_chunk_size or max(1, int(mask.sum()))
        logps, entropy = linear_token_logps(states, head.weight, batch.completion_ids[mask], head.bias,
                                            temperature, chunk, with_entropy, self.head_matmul_dtype(head))
        full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        out = full.masked_scatter(mask, logps)
        return out, (full.masked_scatter(mask, entropy) if with_entropy else None)

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        """Per-token log pi_theta(completion token), Shape (B, T) float32 (0 where masked), with grad;
        and, if asked, the per-token entropy in nats (detached)."""
        if not torch.is_grad_enabled():  # old log-probs, evaluation: never with dropout, whatever the settings
            with eval_mode(self.model):
                return self._logps(batch, temperature, with_entropy)
        return self._logps(batch, temperature, with_entropy)

    def _route(self):
        """(what to call for the policy's forward, its (body, output layer) or None): under data parallelism a
        forward with gradients goes through the DDP wrapper (plain path, logits); else the model, fused if it can."""
        if self.train_forward is not None and torch.is_grad_enabled():
            return (lambda **kwargs: self.train_forward("policy", **kwargs)), None
        return self.model, self.fused_parts(self.model)

    def _logps(self, batch: SequenceBatch, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor | None]:
        model, parts = self._route()
        if parts is not None:
            return self._fused(parts, batch, temperature, with_entropy)
        if self.padding_free:
            mode = packing_mode(self.model)
            with self.autocast():
                packed = packed_completion_logits(model, batch, mode, self.share_prompts)
            if packed is not None:
                return self._scatter_plain(packed, batch, temperature, with_entropy)
        with self.autocast():
            logits = completion_logits(model, batch)
        logps = token_logps(logits, batch.completion_ids, temperature, self.logits_chunk_size)
        logps = logps.masked_fill(~batch.completion_mask, 0.0)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), temperature, self.logits_chunk_size)
                entropy = entropy.masked_fill(~batch.completion_mask, 0.0)
        return logps, entropy

    def _scatter_plain(self, logits: Tensor, batch: SequenceBatch, temperature: float, with_entropy: bool
                       ) -> tuple[Tensor, Tensor | None]:
        """(B, T) log-probs (and entropies) from the packed logits (n, V) of the counted tokens."""
        mask = batch.completion_mask
        logps = token_logps(logits[None], batch.completion_ids[mask][None], temperature, self.logits_chunk_size)[0]
        full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                h = token_entropy(logits.detach()[None], temperature, self.logits_chunk_size)[0]
            entropy = full.masked_scatter(mask, h)
        return full.masked_scatter(mask, logps), entropy

    @torch.no_grad()
    def support_log_mass(self, batch: SequenceBatch, temperature: float, top_p: float, top_k: int) -> Tensor:
        """log of the mass the top-k / top-p sampler's support (the chosen token included) has under pi_theta at each
        completion position (:func:`prefzoo.objective.support_log_mass`), Shape (B, T) float32 (<= 0; 0 where
        masked), no grad: ``logps - support_log_mass`` is pi_theta renormalised over that support. Four rows at a
        time through the plain path (the full logits are needed); one extra no-grad pass of the policy."""
        pieces = []
        with eval_mode(self.model):
            for part in batch.chunks(4):
                with self.autocast():
                    logits = completion_logits(self.model, part)
                mass = support_log_mass(logits, part.completion_ids, temperature, top_p, top_k, self.logits_chunk_size)
                pieces.append(mass.masked_fill(~part.completion_mask, 0.0))
        return torch.cat(pieces) if pieces else torch.zeros(batch.completion_mask.shape)

    @torch.no_grad()
    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_ref(completion token), Shape (B, T) float32, no grad.

        Raises:
            ModelError: the run was set up without a reference (the algorithm declared it needs none).
        """
        if self.reference is None:
            raise ModelError("this policy has no reference model: the algorithm declared it needs none "
                             "(e.g. GRPO with objective.beta=0). Set objective.beta > 0 to use one.")
        return self._frozen_logps(self.reference, batch, temperature)

    @torch.no_grad()
    def teacher_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_T(completion token) of the teacher, Shape (B, T) float32, no grad.

        Raises:
            ModelError: the run has no teacher (only ``algo=distill`` declares one).
        """
        return self._frozen_logps(self._teacher(), batch, temperature)

    def _teacher(self) -> Reference:
        if self.teacher is None:
            raise ModelError("this policy has no teacher: only an algorithm that declares one (algo=distill with "
                             "algo.teacher=...) gets it.")
        return self.teacher

    def token_logits(self, batch: SequenceBatch, teacher: bool = False) -> TokenLogits:
        """The next-token logits at the batch's counted positions (``completion_mask``'s True entries, row-major),
        :class:`~prefzoo.objective.TokenLogits`: the policy's with gradients, or the teacher's (``teacher=True``)
        without, at temperature 1. Linear form (final hidden states (N, d), output layer (V, d)) on the fused path;
        full (N, V) logits where the fused path does not apply (a model whose logits are not its output layer on the
        last hidden state) and under data parallelism (the forward must go through the DDP wrapper, which returns
        logits). When the two output layers differ in rows (a padded embedding), both are cut to the tokenizer's
        tokens."""
        return self._over_vocabulary(self._token_logits(batch, teacher))

    def _token_logits(self, batch: SequenceBatch, teacher: bool) -> TokenLogits:
        mask = batch.completion_mask
        if teacher:
            module = self._teacher().module
            with torch.no_grad(), eval_mode(module), self._teacher().context():
                parts = self.fused_parts(module)
                if parts is not None:
                    return TokenLogits(self._states(parts[0], batch), parts[1].weight, parts[1].bias)
                with self.autocast():
                    return TokenLogits(logits=completion_logits(module, batch)[mask])
        model, parts = self._route()
        if parts is not None:
            return TokenLogits(self._states(parts[0], batch), parts[1].weight, parts[1].bias)
        with self.autocast():
            return TokenLogits(logits=completion_logits(model, batch)[mask])

    def _over_vocabulary(self, side: TokenLogits) -> TokenLogits:
        """``side`` over the tokenizer's tokens only when the teacher's output layer and the student's differ in rows
        (a padded embedding on one side: the rows past the tokenizer's tokens stand for no token); else unchanged."""
        rows = lambda module: module.get_output_embeddings().weight.shape[0]  # noqa: E731
        if self.teacher is None or rows(self.teacher.module) == rows(self.model):
            return side
        n = len(self.tokenizer)
        if side.logits is not None:
            return TokenLogits(logits=side.logits[:, :n])
        return TokenLogits(side.states, side.weight[:n], None if side.bias is None else side.bias[:n])

    @torch.no_grad()
    def _frozen_logps(self, frozen: Reference, batch: SequenceBatch, temperature: float) -> Tensor:
        """Per-token log-probs of a frozen network (the reference or the teacher), (B, T) float32, under
        ``torch.inference_mode``, in eval mode."""
        module = frozen.module
        was_training = module.training
        module.eval()
        try:
            with torch.inference_mode(), frozen.context():
                parts = self.fused_parts(module)
                if parts is not None:
                    logps, _ = self._fused(parts, batch, temperature, False)
                else:
                    with self.autocast():
                        packed = packed_completion_logits(module, batch, packing_mode(module), self.share_prompts) \
                            if self.padding_free else None
                    if packed is not None:
                        logps, _ = self._scatter_plain(packed, batch, temperature, False)
                    else:
                        with self.autocast():
                            logits = completion_logits(module, batch)
                        logps = token_logps(logits, batch.completion_ids, temperature, self.logits_chunk_size)
                        logps = logps.masked_fill(~batch.completion_mask, 0.0)
        finally:
            module.train(was_training)
        return logps.clone()  # a normal tensor (inference tensors cannot be saved for a backward later)

    def logps_and_values(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
                         ) -> tuple[Tensor, Tensor | None, Tensor]:
        """:meth:`logps` and :meth:`values` of one batch, from ONE forward of the body when the value head sits on
        the policy's own trunk (``algo.value_adapter=shared``; fused path, no data-parallel wrapper): the same
        final hidden states feed the output layer and the value head. Otherwise (a separate value adapter, whose
        hidden states differ from the policy's from the first layer on, or the plain path) the two calls.

        Returns:
            (log-probs Shape (B, T) float32 with grad, entropy Shape (B, T) detached or None, values Shape (B, T)
            float32 with grad), each 0 where ``completion_mask`` is False; equal to the two calls' up to float
            rounding (``tests/models/test_value.py``).
        """
        vm = self.value_model
        shared = (vm is not None and vm.adapter is None and not vm.owns_backbone and vm.model is self.model
                  and self.train_forward is None)
        parts = self.fused_parts(self.model) if shared else None
        if parts is None:
            logps, entropy = self.logps(batch, temperature, with_entropy)
            return logps, entropy, self.values(batch)
        mode = contextlib.nullcontext() if torch.is_grad_enabled() else eval_mode(self.model)
        with mode:
            states = self._states(parts[0], batch)
            logps, entropy = self._fused(parts, batch, temperature, with_entropy, states)
        values = vm.head(states.float()).squeeze(-1)
        full = torch.zeros(batch.completion_mask.shape, dtype=values.dtype, device=values.device)
        return logps, entropy, full.masked_scatter(batch.completion_mask, values)

    def values(self, batch: SequenceBatch) -> Tensor:
        """Per-token value estimates V(prefix up to before each completion token), Shape (B, T), with grad."""
        if self.value_model is None:
            raise ModelError("this policy has no value head: only algorithms whose declaration has a value_head get one.")
        with self.autocast():
            if self.train_forward is not None and torch.is_grad_enabled():
                return self.train_forward("value", batch)
            if not torch.is_grad_enabled():  # old values: no dropout
                with eval_mode(self.value_model):
                    return self.value_model(batch)
            return self.value_model(batch)

    def save_value_head(self, folder: Path, extra: dict | None = None) -> Path:
        """Write the value model (adapter + head + how to rebuild it) into ``folder``
        (:meth:`prefzoo.models.value.ValueModel.save_pretrained`)."""
        if self.value_model is None:
            raise ModelError("this policy has no value head to save: the algorithm declared none.")
        return self.value_model.save_pretrained(Path(folder), extra=extra)

    @contextlib.contextmanager
    def seeded(self, generator: torch.Generator):
        """Inside the block, :meth:`sample` draws from ``generator`` (for prompts without rollout seeds); the
        policy's own generator is back afterwards, however the block ends. The evaluator uses it so that the same
        policy gives the same samples before and after training without touching the training run's random
        stream."""
        saved, self.generator = self.generator, generator
        try:
            yield self
        finally:
            self.generator = saved

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` completions per prompt from the current policy, drawn by its engine (``self.engine``,
        see :mod:`prefzoo.rollout.engine`).

        When ``prompts.columns`` holds :data:`ROLLOUT_SEED_COLUMN`, prompt i's samples depend on its seed alone:
        the same prompt and seed give the same samples whatever else is in the batch. Otherwise they come from
        ``self.generator``.
        """
        if self.engine is None:
            raise ModelError("this policy was built without a rollout engine, so it cannot sample; pass engine= "
                             "(e.g. prefzoo.rollout.engine.HFEngine()).")
        with self.autocast():
            return self.engine.sample(self.model, prompts, num_samples, params, eos_token_ids=self.eos_token_ids,
                                      pad_id=self.pad_id, generator=self.generator)
