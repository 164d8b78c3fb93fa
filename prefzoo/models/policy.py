"""A causal language model (with its LoRA adapter, reference and optional value head) as a :class:`Policy`.

This is where a transformer meets the plugin interface of :mod:`prefzoo.algos.base`: plugins ask for
per-token log-probs of completion tokens, reference log-probs, values and samples, and never see the
model class.

Layout: a row is ``[left-padded prompt | right-padded completion]``. Position ids count real tokens
only, so the same sequence gives the same log-probs whatever its padding. Only the C positions that
predict completion tokens go through the output layer (``logits_to_keep``), never the prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from prefzoo.algos.base import PromptBatch, SamplingParams, SequenceBatch
from prefzoo.errors import ModelError
from prefzoo.models.reference import Reference
from prefzoo.objective import token_entropy, token_logps
from prefzoo.rollout.generate import position_ids_from_mask, sample_completions


def completion_logits(model: nn.Module, batch: SequenceBatch) -> Tensor:
    """Logits at the positions that predict each completion token. Shape (B, C, V), the model's dtype."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    c = batch.completion_ids.shape[1]
    out = model(input_ids=input_ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                use_cache=False, logits_to_keep=c + 1)
    return out.logits[:, :-1]


class CausalLMPolicy:
    """Policy interface over a Hugging Face causal LM.

    Args:
        model: the trainable model (a peft ``PeftModel`` under LoRA).
        tokenizer: its tokenizer (pad and EOS ids come from it).
        reference: how pi_ref is computed, or None when the algorithm needs no reference.
        value_model: a module mapping a :class:`SequenceBatch` to per-token values (PPO), or None.
        logits_chunk_size: positions per chunk when turning logits into log-probs (bounds float32 copies).
    """

    def __init__(self, model: nn.Module, tokenizer, reference: Reference | None = None,
                 value_model: nn.Module | None = None, logits_chunk_size: int | None = 64,
                 generator: torch.Generator | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.reference = reference
        self.value_model = value_model
        self.logits_chunk_size = logits_chunk_size
        self.generator = generator
        self.pad_id = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, Tensor | None]:
        """Per-token log pi_theta(completion token), Shape (B, C) float32 (0 where masked), with grad;
        and, if asked, the per-token entropy in nats (detached)."""
        logits = completion_logits(self.model, batch)
        logps = token_logps(logits, batch.completion_ids, temperature, self.logits_chunk_size)
        logps = logps.masked_fill(~batch.completion_mask, 0.0)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = token_entropy(logits.detach(), temperature, self.logits_chunk_size)
                entropy = entropy.masked_fill(~batch.completion_mask, 0.0)
        return logps, entropy

    @torch.no_grad()
    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_ref(completion token), Shape (B, C) float32, no grad.

        Raises:
            ModelError: the run was set up without a reference (the algorithm declared it needs none).
        """
        if self.reference is None:
            raise ModelError("this policy has no reference model: the algorithm declared it needs none "
                             "(e.g. GRPO with objective.beta=0). Set objective.beta > 0 to use one.")
        module = self.reference.module
        was_training = module.training
        module.eval()
        try:
            with self.reference.context():
                logits = completion_logits(module, batch)
                logps = token_logps(logits, batch.completion_ids, temperature, self.logits_chunk_size)
        finally:
            module.train(was_training)
        return logps.masked_fill(~batch.completion_mask, 0.0)

    def values(self, batch: SequenceBatch) -> Tensor:
        """Per-token value estimates V(prefix up to before each completion token), Shape (B, C), with grad."""
        if self.value_model is None:
            raise ModelError("this policy has no value head: only algorithms that declare needs_value_head get one.")
        return self.value_model(batch)

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` completions per prompt from the current policy (see :mod:`prefzoo.rollout`)."""
        was_training = self.model.training
        self.model.eval()
        try:
            batch, _ = sample_completions(self.model, prompts, num_samples, params, eos_token_ids=self.eos_token_ids,
                                          pad_id=self.pad_id, generator=self.generator)
        finally:
            self.model.train(was_training)
        return batch
