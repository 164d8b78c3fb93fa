"""A preallocated ("static") KV cache for the decode loop: written in place, never concatenated.

``transformers``' default ``DynamicCache`` grows by ``torch.cat`` at every decode step, in every layer: each step
reallocates and copies the whole cache (2 x layers tensors of Shape (B, H_kv, L, d)), and dropping a finished row
(``batch_select_indices``) copies it again. :class:`PreallocatedKV` instead takes the prefill's cache once, copies it
(repeated for the samples of each prompt) into buffers of Shape (B, H_kv, capacity, d) per layer, and each decode
step writes its one new position into them: ``update`` is a slice copy and returns views of the filled prefix, so
attention reads exactly the keys the dynamic cache would hold (same length, same values). The write position is one
Python int shared by every layer (:attr:`PreallocatedKV.length`), advanced once per step by the loop, not per layer.

The attention mask lives in a preallocated buffer too (:meth:`PreallocatedKV.step_mask`): Shape (B, 1, 1, capacity)
in the format of the model's attention function -- bool (True: attend) for SDPA, additive float (0 / dtype min) for
eager -- with the new position switched on each step, so ``transformers`` does not rebuild a 4-D mask from a 2-D one
at every step. For another attention implementation (flash-attention, flex) the 2-D mask buffer is passed instead
and ``transformers`` builds its own (the layers report their sizes through ``get_mask_sizes``).

Rows that finish stay in the buffers (their outputs are ignored) until a quarter of them are finished; then the
buffers are compacted to the live rows (:meth:`PreallocatedKV.keep`), so a rollout compacts O(log B) times, not once
per finished row.

For a compiled decode step (``fixed_shapes``) every step has the same shapes instead: ``update`` writes at a position
held in a one-element tensor and returns the whole buffers, the mask covers the whole capacity (positions not written
yet are masked out), and finished rows stay to the end.

Only caches whose every layer is a plain full-attention ``DynamicLayer`` are converted (:func:`can_preallocate`):
sliding-window, linear-attention or quantized layers keep the dynamic path.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

__all__ = ["PreallocatedKV", "PreallocatedLayer", "can_preallocate", "mask_format"]

#: the mask functions of ``transformers`` that build a prebuilt 4-D mask, and its format
_FOUR_D_MASKS = {sdpa_mask: "bool", eager_mask: "float"}


def mask_format(model) -> str:
    """How the decode step hands ``model`` its attention mask: ``bool`` or ``float`` (a prebuilt (B, 1, 1, L) mask) or
    ``2d`` (the (B, L) padding mask; ``transformers`` builds the rest), from the mask function ``transformers`` has
    registered for the config's attention implementation (``AttentionMaskInterface``: ``sdpa`` and every
    implementation registered with SDPA's mask, :mod:`prefzoo.models.attention`'s included, take a bool mask;
    ``eager`` a float one)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    function = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) if isinstance(implementation, str) else None
    return _FOUR_D_MASKS.get(function, "2d")


def can_preallocate(cache) -> bool:
    """True when every layer of ``cache`` (the prefill's) is exactly a full-attention ``DynamicLayer`` holding keys."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None
                                and layer.keys.dim() == 4 for layer in layers)


class _Cursor:
    """The write position shared by all layers of one cache (tokens already cached): a Python int, and, in the
    fixed-shape mode, the same as a one-element tensor (what a compiled step indexes with)."""

    __slots__ = ("length", "index")

    def __init__(self, length: int, index: Tensor | None = None):
        self.length = length
        self.index = index


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers of Shape (B, H_kv, capacity, d), filled up to the shared cursor."""

    def __init__(self, keys: Tensor, values: Tensor, cursor: _Cursor):
        super().__init__()
        self.keys, self.values, self.cursor = keys, values, cursor
        self.device = keys.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if self.cursor.index is not None:  # fixed shapes: write at the index tensor, attend over the whole buffer
            self.keys.index_copy_(2, self.cursor.index, key_states)
            self.values.index_copy_(2, self.cursor.index, value_states)
            return self.keys, self.values
        start = self.cursor.length
        end = start + key_states.shape[-2]
        self.keys[:, :, start:end].copy_(key_states)
        self.values[:, :, start:end].copy_(value_states)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.cursor.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cursor.length + query_length, 0

    def get_max_length(self) -> int:
        return self.keys.shape[-2]

    def batch_select_indices(self, indices: Tensor) -> None:
        self.keys = self.keys.index_select(0, indices)
        self.values = self.values.index_select(0, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a preallocated decode cache is not cropped")


class PreallocatedKV:
    """The prefill's cache moved into preallocated buffers, with the attention mask buffer beside it.

    Args:
        cache: the prefill's ``transformers`` cache (``can_preallocate(cache)``); its layers are replaced in place,
            so ``cache`` itself is what the decode steps pass to the model (:attr:`cache`).
        prompt_mask: Shape (P_rows, P) bool, the prompts' padding mask (True: a real token).
        repeats: rows per prompt (the cache and the mask are repeated ``repeats`` times, interleaved).
        capacity: positions to hold, prompt included (P + the tokens the loop will feed).
        fmt: the mask format (:func:`mask_format`).
        dtype: the model's float dtype (for a ``float`` mask).
        fixed_shapes: every step sees the same shapes (for a compiled step): ``update`` writes one position at an
            index tensor and returns the whole buffers, the mask covers the whole capacity (positions not written yet
            are masked out). Needs a 4-D mask format, one query position per step, and no :meth:`keep`.
    """

    def __init__(self, cache, prompt_mask: Tensor, repeats: int, capacity: int, fmt: str, dtype: torch.dtype,
                 fixed_shapes: bool = False):
        p = prompt_mask.shape[1]
        if fixed_shapes and fmt == "2d":
            raise ValueError("fixed_shapes needs a 4-D mask format (sdpa or eager attention)")
        self.cursor = _Cursor(p, torch.tensor([p], device=prompt_mask.device) if fixed_shapes else None)
        self.fmt = fmt
        layers = []
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            shape = (k.shape[0] * repeats, k.shape[1], capacity, k.shape[3])
            keys = k.new_zeros(shape)
            values = v.new_zeros(shape[:3] + (v.shape[3],))
            keys[:, :, :p].copy_(k.repeat_interleave(repeats, dim=0) if repeats > 1 else k)
            values[:, :, :p].copy_(v.repeat_interleave(repeats, dim=0) if repeats > 1 else v)
            layers.append(PreallocatedLayer(keys, values, self.cursor))
        cache.layers[:] = layers
        self.cache = cache
        rows = prompt_mask.shape[0] * repeats
        attend = torch.zeros((rows, capacity), dtype=torch.bool, device=prompt_mask.device)
        attend[:, :p] = prompt_mask.repeat_interleave(repeats, dim=0) if repeats > 1 else prompt_mask
        if fmt == "float":
            self._mask = torch.full((rows, 1, 1, capacity), torch.finfo(dtype).min, dtype=dtype,
                                    device=prompt_mask.device)
            self._mask[:, 0, 0].masked_fill_(attend, 0.0)
        elif fmt == "bool":
            self._mask = attend[:, None, None, :].clone()
        else:
            self._mask = attend.long()

    @property
    def length(self) -> int:
        """Positions cached so far (prompt included)."""
        return self.cursor.length

    def step_mask(self, query_length: int = 1) -> Tensor:
        """The mask for feeding ``query_length`` new positions: those switched on, a view of the filled prefix.
        Shape (B, 1, 1, length + query_length) (4-D formats) or (B, length + query_length) (``2d``)."""
        start, end = self.cursor.length, self.cursor.length + query_length
        if self.fmt == "float":
            self._mask[..., start:end] = 0.0
        elif self.fmt == "bool":
            self._mask[..., start:end] = True
        else:
            self._mask[:, start:end] = 1
        return self._mask if self.cursor.index is not None else self._mask[..., :end]

    def advance(self, n: int = 1) -> None:
        """After a forward of ``n`` new positions: they are cached."""
        self.cursor.length += n
        if self.cursor.index is not None:
            self.cursor.index.add_(n)

    def keep(self, indices: Tensor) -> None:
        """Keep only the rows ``indices`` (Shape (n,) long) in every buffer, in that order."""
        if self.cursor.index is not None:
            raise ValueError("a fixed-shape cache keeps all its rows")
        self.cache.batch_select_indices(indices)
        self._mask = self._mask.index_select(0, indices)
