"""Turn sampled token ids into text and score them with the reward functions (the online algorithms' scorer)."""

from __future__ import annotations

import torch
from torch import Tensor

from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SequenceBatch


class TextScorer:
    """``scorer(samples, prompts) -> rewards`` Shape (B,) float32, as :data:`prefzoo.algos.base.Scorer`.

    Decodes each completion (special tokens dropped), repeats the prompt's columns for its samples (not the
    loop's ``rollout_seed``), and calls the reward function. After each call ``last_metrics`` holds the mean
    of each reward function (``reward/<name>``) and ``last_texts`` the decoded completions.
    """

    def __init__(self, tokenizer, reward_fn, pad_id: int):
        self.tokenizer, self.reward_fn, self.pad_id = tokenizer, reward_fn, pad_id
        self.last_metrics: dict[str, float] = {}
        self.last_texts: list[str] = []

    def __call__(self, samples: SequenceBatch, prompts: PromptBatch) -> Tensor:
        ids = samples.completion_ids.masked_fill(~samples.completion_mask, self.pad_id)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        which = samples.prompt_index.tolist()
        cols = {k: [v[i] for i in which] for k, v in prompts.columns.items() if k != ROLLOUT_SEED_COLUMN}
        prompt_texts = cols.pop("prompt_text")
        rewards = self.reward_fn(prompt_texts, texts, **cols)
        components = getattr(self.reward_fn, "last_components", {}) or {}
        self.last_metrics = {f"reward/{k}": sum(v) / max(1, len(v)) for k, v in components.items()}
        self.last_texts = texts
        return torch.tensor([float(r) for r in rewards], dtype=torch.float32, device=samples.completion_ids.device)
