"""Padding-free forward passes: a batch's rows packed into ONE sequence of exactly their real tokens.

The padded layout ``[left-padded prompt | right-padded completion]`` runs B x (P + C) positions through the model,
P and C the LONGEST prompt and completion of the batch: a pair of 3 and 200 completion tokens costs 2 x 200. Packed,
the batch is one row of its real tokens only; every log-prob and value pass of an offline plugin goes through it
(:meth:`prefzoo.models.policy.CausalLMPolicy.logps`, ``ref_logps``, the value model), so a plugin gets it without
asking (``model.fast.padding_free``).

Layout. Rows with the same prompt (DPO's chosen and rejected; any two pairs on one prompt) form a GROUP, laid out
as ``[prompt | completion_1 | completion_2 | ...]`` with the prompt ONCE (as ``share_prompts`` does in the padded
path with a KV cache); groups follow one another. Position ids restart at each group: the prompt counts 0 .. P-1
and every completion of the group continues from P, so each token has the position it has in the padded layout
(where positions count real tokens only). Attention (a :class:`Segment` per group): a prompt token sees the earlier
prompt tokens, a completion token the whole prompt and the earlier tokens of its own completion, nothing of
another completion or group -- exactly the keys it sees padded. The hidden state predicting completion token j of
a row is the row's previous real token (the prompt's last for j = 0), gathered by :attr:`Packed.source` for each
COUNTED completion token (``completion_mask``); a completion's tokens without a loss (``token_mask``: a conversation's
user turns in SFT, an environment's tokens) are packed as the context they are in the padded pass, and gathered by
nothing.

Attention kernel, measured (bench/bench_packing.py, 1 thread, SmolLM2's 9 query / 3 key-value heads, head 64,
forward + backward of one layer, 8 segments of 256 tokens): SDPA over the pack with a 4-D block-causal mask
(what ``transformers`` 5 builds on CPU from restarting ``position_ids``, ``masking_utils.find_packed_sequence_indices``)
1.74 s, because CPU SDPA computes every masked block of the N x N scores; one SDPA call per segment 0.24 s, as fast
as the padded batch (0.22 s). FlexAttention, which skips empty blocks, has no CPU backward in torch 2.13
(``NotImplementedError``). So the segments run through :data:`PACKED_SDPA`, an attention function registered with
``transformers``' ``AttentionInterface`` that calls SDPA once per segment (causal, or the group's small mask) and
hands every call without segments (sampling, padded passes) to the function the model had. Models on a
flash-attention implementation instead use ``transformers``' own packed path (``position_ids`` alone, its varlen
kernels), one segment per row (no shared prompt). Others (eager, sliding-window or soft-capped attention) stay
padded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prefzoo.errors import ModelError
from prefzoo.types import SequenceBatch

log = logging.getLogger(__name__)

__all__ = ["PACKED_SDPA", "SEGMENTS_KWARG", "Segment", "Packed", "pack_batch", "packing_mode", "use_packed_attention",
           "packed_attention", "packed_states", "packed_forward_kwargs"]

#: the attention implementation that runs packed segments (and hands other calls to the one the model had)
PACKED_SDPA = "prefzoo_sdpa_packed"
#: the forward keyword (passed through ``transformers``' ``**kwargs`` down to the attention function)
SEGMENTS_KWARG = "prefzoo_segments"
#: attention implementations whose ``position_ids``-only packed path ``transformers`` runs with varlen kernels
POSITION_ID_PACKING = ("flash_attention_2", "flash_attention_3")

_delegates: dict[str, str] = {}  # registered packed name -> the implementation it hands unpacked calls to


@dataclass(frozen=True)
class Segment:
    """One group of the pack: positions [start, end) of the packed row.

    ``mask`` is the group's (n, n) bool attention mask (True: may attend) when several completions share its prompt,
    or None: plain causal attention (one row)."""

    start: int
    end: int
    mask: Tensor | None = None


@dataclass
class Packed:
    """A batch packed into one row. N = packed tokens, n = counted completion tokens of the batch.

    Attributes:
        input_ids: Shape (1, N) long.
        position_ids: Shape (1, N) long, restarting at each group (module docstring).
        segments: the groups, in order, covering [0, N).
        source: Shape (n,) long, the packed position whose hidden state predicts each counted completion token, in
            the order of ``batch.completion_mask``'s True entries (row-major: what ``x[batch.completion_mask]`` gives).
    """

    input_ids: Tensor
    position_ids: Tensor
    segments: tuple[Segment, ...]
    source: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _contiguous(mask: Tensor, lengths: Tensor, side: str) -> bool:
    cols = torch.arange(mask.shape[1], device=mask.device)[None, :]
    want = cols >= (mask.shape[1] - lengths)[:, None] if side == "left" else cols < lengths[:, None]
    return bool(torch.equal(mask, want))


def pack_batch(batch: SequenceBatch, share_prompts: bool = True) -> Packed | None:
    """The packed layout of ``batch`` (module docstring), or None when it has none that equals the padded pass:
    masks that are not a left-aligned prompt / right-aligned completion run (``completion_tokens``: with a
    ``token_mask``, counted tokens among them), or a row with counted completion tokens but no prompt token (nothing
    predicts its first token). Rows without counted tokens are left out.

    A row whose completion holds tokens without a loss (``token_mask``: an environment's tokens in a multi-turn
    trajectory, a conversation's user turns in SFT) packs all of its completion tokens, as the padded pass attends to
    them all, and gathers the predicting positions of the counted ones only.

    ``share_prompts``: rows with the same prompt tokens share one copy of it (False: every row its own segment).
    """
    tokens, counted = batch.completion_tokens, batch.completion_mask
    p_len, c_len = batch.prompt_mask.sum(1), tokens.sum(1)
    if not (_contiguous(batch.prompt_mask, p_len, "left") and _contiguous(tokens, c_len, "right")):
        return None
    if bool((counted & ~tokens).any()):
        return None
    n_counted = counted.sum(1)
    if bool(((n_counted > 0) & (p_len == 0)).any()):
        return None
    width = batch.prompt_ids.shape[1]
    prompts = batch.prompt_ids.tolist()
    p_len, c_len, n_counted = p_len.tolist(), c_len.tolist(), n_counted.tolist()
    groups: dict[tuple, list[int]] = {}
    for b in range(len(prompts)):
        if n_counted[b] == 0:
            continue
        key = tuple(prompts[b][width - p_len[b]:]) if share_prompts else (b,)
        groups.setdefault(key, []).append(b)
    device = batch.prompt_ids.device
    ids, pos, segments = [], [], []
    row_start = {}  # row -> packed position of its first completion token
    last_prompt = {}  # row -> packed position of its prompt's last token
    offset = 0
    for rows in groups.values():
        first = rows[0]
        p = p_len[first]
        ids.append(batch.prompt_ids[first, width - p:])
        pos.append(torch.arange(p, device=device))
        start, cursor = offset, offset + p
        sub = [torch.full((p,), -1, dtype=torch.long, device=device)]
        for r in rows:
            c = c_len[r]
            ids.append(batch.completion_ids[r, :c])
            pos.append(torch.arange(p, p + c, device=device))
            sub.append(torch.full((c,), r, dtype=torch.long, device=device))
            row_start[r], last_prompt[r] = cursor, offset + p - 1
            cursor += c
        mask = None
        if len(rows) > 1:
            s = torch.cat(sub)
            n = s.shape[0]
            causal = torch.ones((n, n), dtype=torch.bool, device=device).tril()
            mask = causal & ((s[None, :] == -1) | (s[None, :] == s[:, None]))
        segments.append(Segment(start, cursor, mask))
        offset = cursor
    source = []
    for b in range(len(prompts)):
        if n_counted[b]:
            # token 0 is predicted by the prompt's last token, token j > 0 by completion token j - 1
            j = counted[b].nonzero()[:, 0]
            source.append(torch.where(j == 0, last_prompt[b], row_start[b] + j - 1))
    if not segments:  # no counted token at all: an empty pack (one pad token keeps shapes valid)
        return Packed(batch.prompt_ids.new_zeros((1, 1)), batch.prompt_ids.new_zeros((1, 1)), (Segment(0, 1),),
                      torch.zeros((0,), dtype=torch.long, device=device))
    return Packed(torch.cat(ids)[None], torch.cat(pos)[None], tuple(segments), torch.cat(source).long())


# ----------------------------------------------------------------------------------------------- attention
def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """``transformers`` attention function: with ``prefzoo_segments`` (a pack), SDPA once per :class:`Segment`;
    without, the implementation the model had before :func:`use_packed_attention` (unchanged).

    Shapes: query (1, H, N, hd), key/value (1, H_kv, N, hd) -> ((1, N, H, hd), None); ``attention_mask`` unused.

    Raises:
        ModelError: a pack reached attention with soft-capping, a sliding window or a position bias (which the
            segments do not apply; :func:`use_packed_attention` refuses such models).
    """
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = _delegates.get(module.config._attn_implementation, "sdpa")
        return ALL_ATTENTION_FUNCTIONS[impl](module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    for name in ("softcap", "sliding_window", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise ModelError(f"padding-free attention does not apply {name}: run this model with "
                             "model.fast.padding_free=false.")
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for seg in segments:
        sl = slice(seg.start, seg.end)
        outs.append(F.scaled_dot_product_attention(query[:, :, sl], key[:, :, sl], value[:, :, sl], attn_mask=seg.mask,
                                                   dropout_p=dropout, scale=scaling, is_causal=seg.mask is None,
                                                   enable_gqa=gqa))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _supports_segments(config) -> str | None:
    """Why ``config``'s attention cannot run packed segments, or None when it can."""
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    for name in ("attn_logit_softcapping", "attention_logit_softcapping"):
        if getattr(config, name, None):
            return "soft-capped attention logits"
    if not getattr(config, "is_causal", True):
        return "bidirectional attention"
    return None


def use_packed_attention(model: nn.Module) -> bool:
    """Switch a ``transformers`` model (peft-wrapped or not) on SDPA (``sdpa`` or prefzoo's grouped-query SDPA) to
    :data:`PACKED_SDPA`; True if switched (or already there). Other implementations, and models whose attention the
    segments would change (sliding window, soft-capping), are left as they are (:func:`packing_mode` then says
    how they pack, if at all)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from prefzoo.models.attention import GQA_SDPA, _register

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(hf, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is not None and current.startswith(PACKED_SDPA):
        return True
    if current not in ("sdpa", GQA_SDPA) or _supports_segments(config) is not None:
        return False
    if current == GQA_SDPA:
        _register()
    name = PACKED_SDPA if current == "sdpa" else f"{PACKED_SDPA}_gqa"
    if name not in _delegates:
        AttentionInterface.register(name, packed_attention)
        AttentionMaskInterface.register(name, sdpa_mask)
        _delegates[name] = current
    try:
        hf.set_attn_implementation(name)
    except (ValueError, AttributeError, TypeError):
        return False
    return getattr(hf.config, "_attn_implementation", None) == name


def packing_mode(module: nn.Module) -> str | None:
    """How ``module`` runs a pack: ``segments`` (:data:`PACKED_SDPA`, prompts shared), ``positions``
    (``transformers``' flash-attention varlen path from ``position_ids``, one segment per row), or None (padded)."""
    hf = module.get_base_model() if hasattr(module, "get_base_model") else module
    impl = getattr(getattr(hf, "config", None), "_attn_implementation", None) or ""
    if impl.startswith(PACKED_SDPA):
        return "segments"
    if impl in POSITION_ID_PACKING:
        return "positions"
    return None


def packed_forward_kwargs(packed: Packed, mode: str) -> dict:
    """The keyword arguments of a packed forward (body or causal LM).

    ``segments``: a 1 x 1 x 1 x 1 placeholder mask, which ``transformers`` passes through as a prepared 4-D mask
    instead of building the N x N block mask from the restarting positions (the segments carry the structure).
    ``positions``: no mask: ``transformers`` detects the packed rows from ``position_ids``.
    """
    kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    if mode == "segments":
        kwargs["attention_mask"] = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=packed.input_ids.device)
        kwargs[SEGMENTS_KWARG] = packed.segments
    return kwargs


def packed_states(body: nn.Module, batch: SequenceBatch, share_prompts: bool = True) -> Tensor | None:
    """Final hidden states predicting each counted completion token, from one packed pass of ``body``.

    Shape: (n, d), in the order of ``batch.completion_mask``'s True entries -- what
    ``prefzoo.models.body.completion_hidden(body, batch)[batch.completion_mask]`` gives padded. None when ``body`` cannot pack
    (:func:`packing_mode`) or the batch has no packed layout (:func:`pack_batch`): the caller runs padded.
    """
    mode = packing_mode(body)
    packed = pack_batch(batch, share_prompts and mode == "segments") if mode else None
    if packed is None:
        return None
    out = body(**packed_forward_kwargs(packed, mode))
    return out.last_hidden_state[0, packed.source]
