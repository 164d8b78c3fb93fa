"""The transformer body's side of the fused log-probs (:mod:`prefzoo.models.policy`): a causal LM's (body, output
layer), whether its logits are the output layer applied to the body's last hidden state (checked once per model), and
the final hidden states at the positions that predict completion tokens, with rows that share a prompt running it
once through a KV cache indexed out to them."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from prefzoo.errors import ModelError
from prefzoo.runtime import KV_CACHE_ARGUMENT
from prefzoo.types import SequenceBatch, position_ids_from_mask

__all__ = ["body_and_head", "unique_prompts", "completion_hidden", "logits_are_head_of_body"]

log = logging.getLogger(__name__)


def body_and_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """(transformer body, output layer) of a causal LM (peft-wrapped or not), or None if it has no plain ones."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(hf, "base_model", None)
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if body is None or body is hf or type(head) is not nn.Linear:
        return None
    return body, head


def unique_prompts(batch: SequenceBatch) -> tuple[Tensor, Tensor] | None:
    """(first row of each distinct prompt, Shape (U,); which of them each row has, Shape (B,)), or None when
    every row's prompt (ids and mask) is distinct."""
    key = torch.cat([batch.prompt_ids, batch.prompt_mask.long()], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == key.shape[0]:
        return None
    first = torch.full((uniq.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    first.scatter_reduce_(0, inverse, torch.arange(key.shape[0], device=key.device), reduce="amin")
    return first, inverse


def completion_hidden(body: nn.Module, batch: SequenceBatch, share_prompts: bool = True) -> Tensor:
    """Final hidden states at the positions that predict each completion token. Shape (B, C, d).

    With ``share_prompts`` and rows that share a prompt, each distinct prompt runs through ``body`` once with a
    KV cache that is then indexed out to its rows (see the module docstring); else one pass over the rows.

    Raises:
        ModelError: a row layout with no prompt column (the first completion token has no predicting position).
    """
    p, c = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    if p == 0:
        raise ModelError("log-probs need at least one prompt column: the first completion token is predicted by "
                         "the position before it (give each row a prompt, e.g. the chat template's header).")
    # HF gradient checkpointing drops the KV cache in training mode: no prompt sharing then
    checkpointing = bool(getattr(body, "is_gradient_checkpointing", False)) and body.training
    groups = unique_prompts(batch) if share_prompts and c > 1 and not checkpointing else None
    if groups is None:
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        mask = batch.attention_mask()
        out = body(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                   use_cache=False)
        return out.last_hidden_state[:, p - 1:p + c - 1]
    first, inverse = groups
    u_ids, u_mask = batch.prompt_ids[first], batch.prompt_mask[first]
    out = body(input_ids=u_ids, attention_mask=u_mask.long(), position_ids=position_ids_from_mask(u_mask),
               use_cache=True)
    cache = getattr(out, KV_CACHE_ARGUMENT)
    if cache is None or cache.get_seq_length() != p:
        raise ModelError(f"{type(body).__name__} returned no KV cache of the prompts; run with share_prompts=False.")
    cache.batch_select_indices(inverse)
    mask = batch.attention_mask().long()
    # positions of the completion columns: real tokens before them (a padding column repeats its neighbour's, never read)
    positions = position_ids_from_mask(mask)[:, p:p + c - 1]
    rest = body(input_ids=batch.completion_ids[:, :c - 1], attention_mask=mask[:, :p + c - 1], position_ids=positions,
                use_cache=True, **{KV_CACHE_ARGUMENT: cache})
    return torch.cat([out.last_hidden_state[inverse, -1:], rest.last_hidden_state], dim=1)


@torch.no_grad()
def logits_are_head_of_body(model: nn.Module, body: nn.Module, head: nn.Linear) -> bool:
    """Whether ``model``'s logits equal ``head(body(...).last_hidden_state)`` on a short input (in eval mode)."""
    was_training = model.training
    model.eval()
    try:
        vocab = head.weight.shape[0]
        ids = (torch.arange(2, 7, device=head.weight.device) * 7919 % vocab)[None]
        want = model(input_ids=ids, use_cache=False).logits.float()
        got = head(body(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception as err:  # noqa: BLE001 - any failure means: use the plain path
        log.debug("fused log-prob check failed: %s", err)
        return False
    finally:
        model.train(was_training)
    return want.shape == got.shape and bool(torch.allclose(want, got, rtol=1e-3, atol=1e-3 * float(want.abs().max())))
