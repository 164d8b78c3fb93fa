"""The shared vocabulary of prefzoo: batches (:mod:`prefzoo.types.batches`); the policy, scorer and engine interfaces,
sampling settings, the resolved objective, the step's context and what a plugin returns
(:mod:`prefzoo.types.contracts`).

Every room of the house speaks these types: the models implement :class:`Policy`, data builds
:class:`SequenceBatch` / :class:`PreferenceBatch` / :class:`PromptBatch`, rollout engines return
:class:`SequenceBatch`, the online plugins return an :class:`Experience`, every plugin's ``loss`` returns a
:class:`LossOutput`. This module imports nothing of prefzoo but :mod:`prefzoo.objective`, so importing it loads
no plugin, model or dataset.

Notation (used in every docstring of prefzoo, DESIGN.md's glossary):

    B   rows of a batch (sequences; for online algorithms B = prompts x G)
    T   completion token positions (the completion axis, right-padded)
    P   prompt token positions (left-padded)
    G   completions sampled per prompt (``num_samples``)
    V   vocabulary size

    logps (B, T)        log pi_theta(y_t | x, y_<t), float32, 0 on padding
    seq_logps (B,)      sum over a row's counted tokens of logps
    ref_logps (B, T)    the same under the reference policy pi_ref (no gradient)
    old_logps (B, T)    the same under the policy that sampled the rollout (no gradient)
    log_ratio           logps - ref_logps (policy vs reference, only)
    is_log_ratio        logps - old_logps (policy vs sampler: the importance-sampling log-ratio); ratio = exp of it
    rewards (B,)        one scalar reward per completion; token_rewards (B, T) per token
    advantages (B, T)   always per token (a sequence-level advantage is repeated over the row's tokens)
    completion_mask     bool, True on the tokens that count (EOS included); never an inverted mask
"""

from prefzoo.objective import TokenLogits
from prefzoo.types.batches import (PROMPT_MESSAGES, ROLLOUT_SEED_COLUMN, Batch, EpisodeLog, Experience, PreferenceBatch,
                                   PromptBatch, Reply, SequenceBatch, UnpairedBatch, episode_metrics, pad_cat,
                                   position_ids_from_mask, sequence_rewards)
from prefzoo.types.contracts import (NO_STEP, CorrectionSettings, DistillationPolicy, LossOutput, LossTokens,
                                     ObjectiveSettings, Policy,
                                     RolloutEngine, SamplingParams, Scorer, StepContext, ValueHeadSpec, ValuePolicy)

__all__ = ["Batch", "SequenceBatch", "Reply", "EpisodeLog", "episode_metrics", "PromptBatch", "PreferenceBatch",
           "DistillationPolicy", "TokenLogits", "UnpairedBatch", "Experience", "SamplingParams", "LossOutput",
           "Policy", "ValuePolicy", "Scorer", "LossTokens", "ObjectiveSettings", "ValueHeadSpec", "ROLLOUT_SEED_COLUMN",
           "PROMPT_MESSAGES", "sequence_rewards", "pad_cat", "CorrectionSettings", "RolloutEngine", "StepContext",
           "NO_STEP", "position_ids_from_mask"]
