"""Turns that end on the tiny model, in the trainer and in the asynchronous rollout worker alike.

The tiny random model draws its end-of-sequence token about once in 49,152 tokens, so on it every multi-turn episode is
one policy turn cut at its length, and no environment is ever asked anything. :func:`end_turns` makes the decode loop
choose EOS wherever a token's seeded uniform falls below :data:`EOS_SHARE` (about one turn in 1 - 0.75^6 = 82% of
6-token turns ends so); the log-prob it reports is EOS's under the sampler's own distribution, which is what the
trainer recomputes, so the samples stay self-consistent (a correction sees no mismatch it did not make). Only seeded
sampling (the training rollouts) is touched: a call without uniforms (greedy evaluation) is the decode loop's own.

:func:`worker` is a rollout worker's builder (``prefzoo.training.build.build_rollout_worker``'s place, set by a test
with ``monkeypatch``): the spawned worker imports this module to find it, applies the same patch in its own process and
builds what the real worker builds.
"""

from __future__ import annotations

#: the share of seeded decode steps that choose EOS
EOS_SHARE = 0.25


def end_turns(setattr=setattr) -> None:
    """Patch :func:`prefzoo.rollout.generate._choose` (``setattr``: a test's ``monkeypatch.setattr``, or the builtin in
    the worker's own process)."""
    import torch

    from prefzoo.models.loading import load_tokenizer
    from prefzoo.rollout import generate

    eos = load_tokenizer("tiny").eos_token_id
    choose = generate._choose

    def ending(logits, params, generator, uniforms):
        token, logp, entropy = choose(logits, params, generator, uniforms)
        if uniforms is None or params.greedy:
            return token, logp, entropy
        forced = uniforms.to(token.device) < EOS_SHARE
        logprobs = (logits / params.temperature).log_softmax(-1)  # (top_p = 1, top_k = 0 in the tests using this)
        token = token.masked_fill(forced, eos)
        logp = torch.where(forced, logprobs[:, eos], logp)
        return token, logp, entropy

    setattr(generate, "_choose", ending)


def worker(cfg):
    """The rollout worker's (model, engine), with turns that end (:func:`end_turns`)."""
    from prefzoo.training.build import build_rollout_worker

    end_turns()
    return build_rollout_worker(cfg)
