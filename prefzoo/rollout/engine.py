"""Rollout engines: what draws a policy's completions (``rollout.engine=hf|vllm``).

Every online plugin samples through :meth:`prefzoo.types.Policy.sample`; :class:`~prefzoo.models.policy.CausalLMPolicy`
hands the call to its engine, so a plugin never knows which engine drew its rollout. An engine takes token ids
and gives token ids back (no second tokenisation), in the layout of :func:`prefzoo.rollout.generate.sample_completions`:
rows [i*G, (i+1)*G) answer prompt i, completions right-padded after the first EOS (the EOS counted), rows
without EOS ``truncated``.

* :class:`HFEngine` (``hf``, the default): prefzoo's own decode loop on the trained model (or its merged-weights
  copy, made by the factory the model side hands it: :func:`prefzoo.models.merged.merged_copy`), in the trainer's process, over a preallocated KV cache by default
  (``rollout.kv_cache``, :mod:`prefzoo.rollout.kv_cache`). On the trained model itself its samples are the trainer's
  own; from the merged copy (other weights: ``W + s B A`` rounded once) it reports the log-probs it sampled with
  (``sample_logps``) when ``report_logps`` (``rollout.log_mismatch``), so the rollout/trainer mismatch is logged as for
  vLLM, at the price of one no-grad pass where the plugin needs none.
* :class:`prefzoo.rollout.vllm_engine.VLLMEngine` (``vllm``, optional): vLLM's offline ``LLM`` beside the trainer,
  fed the LoRA adapter after every optimizer step; it fills ``sample_logps`` with the log-probs it sampled with,
  from which the rollout's engine/trainer mismatch is logged and, with ``rollout.correction.mode``, corrected
  (:func:`prefzoo.objective.correction_weights`; docs/off-policy.md).
* :class:`prefzoo.rollout.vllm_server.VLLMServerEngine` (``vllm_server``): N vLLM servers over HTTP (``rollout.servers``,
  started with ``prefzoo serve``), sent the LoRA adapter after every optimizer step, with ``sample_logps`` as ``vllm``.

Per-prompt seeds (:data:`prefzoo.types.ROLLOUT_SEED_COLUMN`) make prompt i's samples depend on its seed alone,
in both engines (each engine has its own random stream: the same seed does not give the same samples in both).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, RolloutEngine, SamplingParams, SequenceBatch

__all__ = ["RolloutEngine", "HFEngine"]


class HFEngine:
    """prefzoo's decode loop (:func:`prefzoo.rollout.generate.sample_completions`) in the trainer's process.

    Args:
        merged_copy: sample from a merged-weights copy of a LoRA model, refreshed from the adapter before each call:
            a factory ``model -> copy or None`` (None: the model cannot be merged), whose copy's ``module()`` is the
            merged model (:func:`prefzoo.models.merged.merged_copy`: the engine knows no model class); None (the
            default): the peft model itself.
        kv_cache: ``static`` (preallocated) or ``dynamic`` (``transformers``' own): see
            :func:`prefzoo.rollout.generate.sample_completions`.
        compile_decode: the decode step through ``torch.compile`` (static cache only).
        report_logps: when sampling from the merged copy, return the log-probs the tokens were sampled with (after
            the temperature, renormalised over the top-k / top-p support) as ``sample_logps`` (the rollout/trainer mismatch is then logged, ``engine/logp_diff_*``).
        exact: the sampler is the policy up to float32 rounding (the model itself, or its merged copy in the model's
            dtype; False for a copy in another dtype, ``rollout.dtype``). Then a call with
            ``params.report_entropy`` returns the sampler's log-probs and entropies (``sample_logps``,
            ``sample_entropy``), which the evaluation uses in place of a pass of the policy.
    """

    name = "hf"

    def __init__(self, merged_copy: Callable[[nn.Module], Any] | None = None, kv_cache: str = "static",
                 compile_decode: bool = False, report_logps: bool = False, exact: bool = True):
        self.merged_copy = merged_copy
        self.exact = exact
        self.kv_cache = kv_cache
        self.compile_decode = compile_decode
        self.report_logps = report_logps
        self._merged = None  # None: not built yet; False: the model cannot be merged

    def sampling_model(self, model: nn.Module) -> nn.Module:
        """The module rollouts run: a merged-weights copy of a LoRA ``model`` (``merged_copy``), else ``model``."""
        if self.merged_copy is not None and self._merged is None:
            self._merged = self.merged_copy(model) or False
        return self._merged.module() if self._merged else model

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
               eos_token_ids: list[int], pad_id: int, generator: torch.Generator | None = None) -> SequenceBatch:
        """Prompt i's samples invert uniforms drawn from its own seed when ``prompts.columns`` holds
        :data:`ROLLOUT_SEED_COLUMN` (:func:`prefzoo.rollout.generate.prompt_uniforms`), else from ``generator``."""
        from prefzoo.rollout.generate import prompt_uniforms, sample_completions

        seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
        uniforms = None
        if seeds is not None and not params.greedy:
            uniforms = prompt_uniforms(list(seeds), num_samples, params.max_new_tokens, prompts.prompt_ids.device)
        was_training = model.training
        model.eval()
        try:
            sampler = self.sampling_model(model)
            batch, logps = sample_completions(sampler, prompts, num_samples, params,
                                              eos_token_ids=list(eos_token_ids), pad_id=pad_id, generator=generator,
                                              uniforms=uniforms, kv_cache=self.kv_cache,
                                              compile_decode=self.compile_decode)
        finally:
            model.train(was_training)
        if self.report_logps and sampler is not model:
            batch.sample_logps = logps
        if params.report_entropy and self.exact:  # (the evaluation's: the policy's log-probs and entropies, sampled)
            batch.sample_logps = logps
        else:
            batch.sample_entropy = None
        return batch

    def close(self) -> None:
        self._merged = None
