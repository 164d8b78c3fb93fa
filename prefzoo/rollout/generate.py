"""Sampling completions from a causal LM: the rollout shared by GRPO, PPO, best-of-n and pair building.

A lean decode loop over the model's KV cache: one prefill of the (left-padded) prompts, then one
forward of one token per row per step, sampling with temperature, top-k and nucleus (top-p) filtering. It
stops when every row has emitted an end-of-sequence token or ``max_new_tokens`` is reached. Compared
with ``transformers``' ``generate`` it skips the generic logits-processor and stopping-criteria machinery
(the tests check it picks the same greedy tokens) and returns the log-probability each token had when it
was sampled.

The KV cache (``kv_cache``, ``rollout.kv_cache``): ``static`` (the default) moves the prefill's cache into buffers
preallocated for the whole rollout and writes one position per step in place, with the attention mask prebuilt
(:mod:`prefzoo.rollout.kv_cache`); ``dynamic`` is ``transformers``' own, grown by concatenation every step in every
layer. ``compile_decode`` runs the static loop's decode step through ``torch.compile`` on fixed shapes. Measured
against the memory-bandwidth floor in ``bench/bench_decode.py``.

Layout of the result: completions right-padded with ``pad_id`` after the first EOS; the EOS itself is a
completion token (it is what the policy chose); rows without EOS are marked ``truncated``.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from prefzoo.runtime import KV_CACHE_ARGUMENT
from prefzoo.objective import support_mask
from prefzoo.rollout.kv_cache import PreallocatedKV, can_preallocate, mask_format
from prefzoo.types import PromptBatch, SamplingParams, SequenceBatch, position_ids_from_mask


def filter_support(logits: Tensor, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """``logits`` with the tokens a top-k / top-p sampler drops set to -inf (:func:`prefzoo.objective.support_mask`:
    top-k first, then the smallest set whose mass reaches ``top_p``; the most likely token always stays).

    Args:
        logits: Shape (B, V), float32, already divided by the temperature.
    """
    if top_p >= 1.0 and not top_k:
        return logits
    return logits.masked_fill(~support_mask(logits, top_p, top_k), float("-inf"))


def sample_from(probs: Tensor, generator: torch.Generator | None = None, uniforms: Tensor | None = None) -> Tensor:
    """One index per row drawn from ``probs`` (Shape (B, V), rows summing to ~1) by inverting the CDF.

    Equivalent in distribution to ``torch.multinomial(probs, 1)`` but needs one uniform per row instead of
    one exponential per vocabulary entry (a large share of decode time at V = 49,152 on a CPU).

    Args:
        uniforms: Shape (B,) in [0, 1), the draws to invert (precomputed, e.g. by :func:`prompt_uniforms`);
            None: drawn here from ``generator``.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    if uniforms is None:
        u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    else:
        u = uniforms.to(device=probs.device, dtype=cdf.dtype).reshape(-1, 1)
    # The first index whose cumulative mass EXCEEDS u * total (right=True): a zero-probability token has a
    # flat cdf step and is never chosen, even for u = 0 (which torch.rand returns once in 2^24 draws); the
    # minimum keeps the target below the total mass after rounding, so trailing zero tokens are skipped too.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[-1] - 1)[:, 0]


def prompt_uniforms(seeds: list[int], num_samples: int, steps: int, device: torch.device | str = "cpu") -> Tensor:
    """The uniforms a rollout inverts, drawn per prompt from its own seed: Shape (len(seeds) * num_samples, steps).

    Rows ``[i*G, (i+1)*G)`` (G = ``num_samples``) come from ``torch.Generator(device).manual_seed(seeds[i])``,
    row-major, float32 in [0, 1): what prompt i's samples draw depends on ``seeds[i]`` alone, not on which
    other prompts share the batch (or the process, under data parallelism).
    """
    out = [torch.rand((num_samples, steps), generator=torch.Generator(device=device).manual_seed(int(s)),
                      device=device) for s in seeds]
    return torch.cat(out) if out else torch.zeros((0, steps), device=device)


KV_CACHES = ("static", "dynamic")


def _choose(logits: Tensor, params: SamplingParams, generator: torch.Generator | None, uniforms: Tensor | None
            ) -> tuple[Tensor, Tensor, Tensor | None]:
    """One decode step's choice from ``logits`` (Shape (n, V) float32): (token Shape (n,) long, its log-prob under the
    distribution it was drawn from, Shape (n,) float32: after the temperature and renormalised over the top-k /
    top-p support, as vLLM's ``processed_logprobs``; greedy: the plain softmax's; and with
    ``params.report_entropy`` that distribution's entropy -sum_v p_v log p_v in nats, Shape (n,), else None)."""
    if params.greedy:
        logprobs = torch.log_softmax(logits, -1)
        token = logits.argmax(-1)
    else:
        kept = filter_support(logits / params.temperature, params.top_p, params.top_k)
        token = sample_from(kept.softmax(-1), generator, uniforms)
        logprobs = torch.log_softmax(kept, -1)
    entropy = None
    if params.report_entropy:  # (-inf log-probs off the support: p = 0 there, so they add nothing)
        entropy = -(logprobs.exp() * logprobs.masked_fill(torch.isinf(logprobs), 0.0)).sum(-1)
    return token, logprobs.gather(-1, token[:, None])[:, 0], entropy


@torch.no_grad()
def sample_completions(model, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
                       eos_token_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
                       uniforms: Tensor | None = None, kv_cache: str = "static", compile_decode: bool = False
                       ) -> tuple[SequenceBatch, Tensor]:
    """Sample ``num_samples`` completions for each prompt.

    Each distinct prompt is run through the model once (prefill); its KV cache is then repeated for its
    ``num_samples`` rows. Finished rows stop costing: the dynamic cache drops them at once; the static cache
    compacts its buffers when a quarter of its rows are finished (:mod:`prefzoo.rollout.kv_cache`).

    Args:
        model: a causal LM taking ``input_ids, attention_mask, position_ids`` and a KV cache.
        prompts: B prompts, left-padded.
        num_samples: G completions per prompt; rows [i*G, (i+1)*G) of the result answer prompt i.
        params: temperature, top_p, max_new_tokens, greedy.
        eos_token_ids: ids that end a completion.
        pad_id: id written after the end.
        generator: random source for sampling (reproducible rollouts).
        uniforms: Shape (B*G, max_new_tokens), the uniform in [0, 1) that row r inverts at step t (e.g. from
            :func:`prompt_uniforms`); when given, ``generator`` is not used. None: drawn from ``generator``.
        kv_cache: ``static`` (preallocated buffers written in place, :class:`prefzoo.rollout.kv_cache.PreallocatedKV`;
            models whose cache it cannot hold, e.g. sliding-window layers, run the dynamic one) or ``dynamic``
            (``transformers``' cache, concatenated each step). Both give the same tokens and log-probs up to float
            rounding (``tests/rollout/test_static_cache.py``).
        compile_decode: (static cache, sdpa or eager attention) run the decode step through ``torch.compile``, on
            fixed shapes (the whole buffers every step, finished rows kept to the end): compiled once per model and
            shape (:func:`compiled_step`); otherwise ignored.

    Returns:
        (batch, sample_logps): the (B*G)-row :class:`SequenceBatch` (with ``prompt_index`` and ``truncated``; with
        ``params.report_entropy`` also ``sample_entropy``, the entropy of each step's distribution, nats), and the
        log-probability of each sampled token under the distribution the sampler drew from (after the temperature
        and the top-k / top-p support), Shape (B*G, C) float32, 0 after the end.

    Raises:
        ValueError: ``uniforms`` of the wrong shape, or an unknown ``kv_cache``.
    """
    device = prompts.prompt_ids.device
    n_prompts = prompts.prompt_ids.shape[0]
    rows = n_prompts * num_samples
    if uniforms is not None and tuple(uniforms.shape) != (rows, params.max_new_tokens):
        raise ValueError(f"uniforms has shape {tuple(uniforms.shape)}; expected (prompts x num_samples, "
                         f"max_new_tokens) = ({rows}, {params.max_new_tokens})")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache={kv_cache!r} is not one of {KV_CACHES}")
    eos = torch.tensor(eos_token_ids, device=device)
    position = position_ids_from_mask(prompts.prompt_mask)
    out = model(input_ids=prompts.prompt_ids, attention_mask=prompts.prompt_mask.long(), position_ids=position,
                use_cache=True, logits_to_keep=1)
    cache = getattr(out, KV_CACHE_ARGUMENT)
    steps = params.max_new_tokens
    result = _Result(rows, steps, pad_id, device, entropy=params.report_entropy)
    logits = out.logits[:, -1].float().repeat_interleave(num_samples, dim=0)
    next_position = position[:, -1:].repeat_interleave(num_samples, dim=0) + 1
    if kv_cache == "static" and can_preallocate(cache):
        fmt = mask_format(model)
        fixed = compile_decode and fmt != "2d"
        kv = PreallocatedKV(cache, prompts.prompt_mask, num_samples, prompts.prompt_ids.shape[1] + max(steps - 1, 0),
                            fmt, cache.layers[0].keys.dtype, fixed_shapes=fixed)
        _decode_static(compiled_step(model) if fixed else model, kv, logits, next_position, params, eos, generator,
                       uniforms, result, compact=not fixed)
    else:
        if num_samples > 1:
            cache.batch_repeat_interleave(num_samples)
        attention = prompts.prompt_mask.long().repeat_interleave(num_samples, dim=0)
        _decode_dynamic(model, cache, logits, attention, next_position, params, eos, generator, uniforms, result)
    lengths = result.lengths
    width = int(lengths.max()) if rows else 0
    completion_mask = torch.arange(width, device=device)[None, :] < lengths[:, None]
    batch = SequenceBatch(
        prompt_ids=prompts.prompt_ids.repeat_interleave(num_samples, dim=0),
        prompt_mask=prompts.prompt_mask.repeat_interleave(num_samples, dim=0),
        completion_ids=result.tokens[:, :width].masked_fill(~completion_mask, pad_id), completion_mask=completion_mask,
        prompt_index=torch.arange(n_prompts, device=device).repeat_interleave(num_samples),
        truncated=~result.finished,
    )
    if result.token_entropy is not None:  # (params.report_entropy)
        batch.sample_entropy = result.token_entropy[:, :width].masked_fill(~completion_mask, 0.0)
    return batch, result.token_logps[:, :width].masked_fill(~completion_mask, 0.0)


class _Result:
    """What the decode loops fill: tokens and log-probs per (row, step), lengths, which rows ended with EOS."""

    def __init__(self, rows: int, steps: int, pad_id: int, device, entropy: bool = False):
        self.tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
        self.token_logps = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        self.token_entropy = torch.zeros((rows, steps), dtype=torch.float32, device=device) if entropy else None
        self.lengths = torch.full((rows,), steps, dtype=torch.long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)

    def record(self, rows: Tensor, t: int, token: Tensor, logp: Tensor, eos: Tensor, entropy: Tensor | None = None
               ) -> Tensor:
        """Store step ``t``'s tokens of ``rows``; the mask (Shape (n,) bool) of those that just ended."""
        self.tokens[rows, t] = token
        self.token_logps[rows, t] = logp
        if entropy is not None:
            self.token_entropy[rows, t] = entropy
        return torch.isin(token, eos)

    def end(self, rows: Tensor, t: int) -> None:
        self.finished[rows] = True
        self.lengths[rows] = t + 1


def _decode_dynamic(model, cache, logits, attention, next_position, params, eos, generator, uniforms, result):
    """The decode loop over ``transformers``' dynamic cache: finished rows dropped from it at once."""
    device = logits.device
    active = torch.arange(logits.shape[0], device=device)
    steps = params.max_new_tokens
    for t in range(steps):
        token, logp, entropy = _choose(logits, params, generator, None if uniforms is None else uniforms[active, t])
        done = result.record(active, t, token, logp, eos, entropy)
        if bool(done.any()):
            result.end(active[done], t)
            keep = (~done).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            active, token = active[keep], token[keep]
            attention, next_position = attention[keep], next_position[keep]
        if t == steps - 1:
            break
        attention = torch.cat([attention, torch.ones(len(active), 1, dtype=attention.dtype, device=device)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
                    use_cache=True, **{KV_CACHE_ARGUMENT: cache})
        logits = out.logits[:, -1].float()
        next_position = next_position + 1


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_step(model):
    """``torch.compile(model, dynamic=True)`` (inductor), built once per model object and kept while it lives.

    Dynamic shapes: one compilation serves every batch size and cache length (with the default, a second shape
    recompiles: measured on the tiny model, 30 s + 34 s instead of 40 s once)."""
    step = _COMPILED.get(model)
    if step is None:
        step = _COMPILED[model] = torch.compile(model, dynamic=True)
    return step


#: the static loop compacts its buffers once this share of their rows has finished
COMPACT_SHARE = 0.25


def _decode_static(model, kv: PreallocatedKV, logits, position, params, eos, generator, uniforms, result,
                   compact: bool = True):
    """The decode loop over preallocated buffers (:class:`PreallocatedKV`).

    ``slots[i]`` is the result row held in buffer row i; ``live`` the buffer rows still writing (None: all of them).
    A finished row stays in the buffers, fed its last token, its outputs ignored, until :data:`COMPACT_SHARE` of the
    buffer rows have finished; then every buffer keeps only the live rows."""
    device = logits.device
    slots = torch.arange(logits.shape[0], device=device)
    live = None
    feed = None
    steps = params.max_new_tokens
    for t in range(steps):
        rows = slots if live is None else slots[live]
        token, logp, entropy = _choose(logits if live is None else logits[live], params, generator,
                                       None if uniforms is None else uniforms[rows, t])
        done = result.record(rows, t, token, logp, eos, entropy)
        if bool(done.any()):
            result.end(rows[done], t)
            still = ~done
            if not bool(still.any()):
                break
            live = (torch.arange(len(slots), device=device) if live is None else live)[still]
            token = token[still]
            if compact and len(slots) - len(live) >= COMPACT_SHARE * len(slots):
                kv.keep(live)
                slots, position, live = slots[live], position[live], None
                feed = None
        if t == steps - 1:
            break
        if live is None:
            feed = token
        else:
            if feed is None:
                feed = torch.zeros(len(slots), dtype=token.dtype, device=device)
            feed[live] = token
        out = model(input_ids=feed[:, None], attention_mask=kv.step_mask(1), position_ids=position,
                    use_cache=True, **{KV_CACHE_ARGUMENT: kv.cache})
        kv.advance(1)
        logits = out.logits[:, -1].float()
        position = position + 1
