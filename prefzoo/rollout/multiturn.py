"""Multi-turn rollouts: the policy writes, an environment or a tool answers, the policy writes again.

:class:`MultiTurnEngine` wraps a rollout engine (:class:`~prefzoo.rollout.engine.HFEngine`) and has the same
interface, so every online plugin's ``make_experience`` gets episodes in place of single completions without a line of
its own changing. One call runs ``B x G`` episodes side by side, turn by turn:

1. Each episode starts (:meth:`Episode.start <prefzoo.environments.contract.Episode.start>` with its dataset row);
   its first text, if any, is appended to the last user message, and the prompt is rendered with the chat template
   (with ``tools=`` where the template renders tools, else prefzoo's default format: the tools in a system message,
   :func:`~prefzoo.environments.tools.default_tools_message`).
2. Every active episode's context (prompt + everything so far) is one row of a left-padded batch, and the wrapped
   engine samples ONE turn per row (``rollout.max_new_tokens``, at most the episode's remaining budget).
3. The turn's ids are kept as sampled (**token in, token out**: never decoded and encoded again); its decoded text is
   parsed (:func:`~prefzoo.environments.tools.parse_turn`) and handed to the environment, whose reply messages are
   rendered with the chat template and tokenised -- only the environment's text is ever tokenised -- and appended.
   The environment's ids are found as the suffix the template adds after an assistant turn's end-of-turn token
   (:func:`environment_ids`).
4. An episode ends when the environment says so, at ``max_turns`` policy turns, when the next reply would not fit
   ``max_tokens`` (completion tokens of both kinds), or on a turn without an end-of-sequence token (cut at its
   length). It always ends on a policy turn.

The result is a :class:`~prefzoo.types.SequenceBatch` whose completion is the whole trajectory after the prompt:
``completion_mask`` marks the policy's tokens, ``token_mask`` every token, ``truncated`` the episodes the budget cut,
``episodes`` the :class:`~prefzoo.types.EpisodeLog` of each row (conversation, environment reward, counts, and with
``env.reward_placement=turn`` each step reward's position: :meth:`~prefzoo.types.SequenceBatch.turn_rewards`). Rows
``[i*G, (i+1)*G)`` answer prompt i, as single-turn rollouts do. Reproducibility: with a
:data:`~prefzoo.types.ROLLOUT_SEED_COLUMN` seed, episode ``(i, j)``'s turn t draws from the seed
``mix(seed_i, j, t)`` alone, so an episode's samples do not depend on which episodes share its batch.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from dataclasses import dataclass, replace
from typing import Callable

import torch

from prefzoo.errors import DataError, EnvironmentFailure
from prefzoo.types import (PROMPT_MESSAGES, ROLLOUT_SEED_COLUMN, EpisodeLog, PromptBatch, SamplingParams,
                           SequenceBatch)

__all__ = ["MultiTurnSettings", "MultiTurnEngine", "environment_ids", "render", "episode_seed"]

#: columns of a prompt batch that are not the dataset row an environment's reset receives
_NOT_ROW = ("prompt_text", ROLLOUT_SEED_COLUMN, PROMPT_MESSAGES, "completion_ids")


@dataclass
class MultiTurnSettings:
    """The episode budget (``env.*``): ``max_turns`` policy turns; ``max_tokens`` completion tokens of both kinds;
    ``reward_placement``: ``trajectory`` (an environment's step rewards add up into the episode's reward) or ``turn``
    (each also recorded with the position of the turn it rewards, :attr:`~prefzoo.types.EpisodeLog.turn_rewards`)."""

    max_turns: int = 4
    max_tokens: int = 384
    reward_placement: str = "trajectory"


def episode_seed(seed: int, sample: int, turn: int) -> int:
    """The seed of sample ``sample``'s turn ``turn`` of a prompt seeded ``seed`` (a hash: independent streams)."""
    digest = hashlib.sha256(f"{int(seed)}:{sample}:{turn}".encode()).digest()
    return int.from_bytes(digest[:7], "little")


def render(tokenizer, messages: list[dict], schemas: list[dict], add_generation_prompt: bool, native: bool) -> str:
    """The conversation as the model reads it: the chat template with ``tools=schemas`` (``native``: the template
    renders tools), else the default format's system message first (an existing system message becomes its first
    lines)."""
    if schemas and native:
        return tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    if schemas:
        from prefzoo.environments.tools import default_tools_message

        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        rest = messages[1:] if system else messages
        messages = [default_tools_message(schemas, system), *rest]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def environment_ids(tokenizer, replies: list[dict], schemas: list[dict], native: bool) -> list[int]:
    """The token ids the chat template puts after an assistant turn's end-of-turn token for ``replies`` (the
    environment's messages), up to and including the next assistant header.

    Found on a two-message conversation (a user message and an assistant turn), rendered without and with the
    replies: the text between the assistant turn's last end-of-sequence token and the end is the replies' part, and
    it alone is tokenised.

    Raises:
        DataError: the template renders the conversation's beginning differently once the replies are added (it
            cannot be extended turn by turn), or has no end-of-sequence token after an assistant turn.
    """
    calls = [{"type": "function", "function": {"name": m.get("name", "tool"), "arguments": {}}}
             for m in replies if m.get("role") == "tool"]
    stub = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", **({"tool_calls": calls[:1]}
                                                                                     if calls and native else {})}]
    before = render(tokenizer, stub, schemas, False, native)
    after = render(tokenizer, stub + replies, schemas, True, native)
    eos = tokenizer.eos_token
    end = before.rfind(eos) if eos else -1
    if end < 0 or not after.startswith(before[:end + len(eos)]):
        raise DataError("the chat template cannot be extended turn by turn (an assistant turn's end-of-sequence token "
                        f"{eos!r} is not followed by the next messages); multi-turn rollouts need a template that "
                        "renders a conversation as the concatenation of its messages.")
    return tokenizer(after[end + len(eos):], add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def _episode_context(where: str, when: str):
    """An environment's error (:class:`~prefzoo.errors.EnvironmentFailure`) names the episode it happened in."""
    try:
        yield
    except EnvironmentFailure as err:
        raise EnvironmentFailure(f"env: {err}, in the episode of {where}, at {when}; fix the environment (the run "
                                 "stopped: an environment's error is not the policy's)", err.method, err.cause) from None


@dataclass
class _Running:
    """One episode in progress."""

    episode: object
    messages: list[dict]  # the whole conversation, the prompt's included (for parsing and the next reply's render)
    prompt_ids: list[int]
    ids: list[int]  # completion ids so far
    policy: list[bool]  # which of them the policy wrote
    logps: list[float]
    log: EpisodeLog
    seed: int | None
    done: bool = False
    where: str = ""  # "prompt i, sample j" of the rollout (an environment's error names its episode)


class MultiTurnEngine:
    """A rollout engine that runs episodes of an environment with another engine's single turns (module docstring).

    Args:
        inner: the engine that samples one turn (``hf``).
        tokenizer: the policy's tokenizer (chat template, decoding, parsing).
        make_episode: zero-argument callable giving a fresh :class:`~prefzoo.environments.contract.Episode`.
        settings: the budget.
    """

    def __init__(self, inner, tokenizer, make_episode: Callable[[], object], settings: MultiTurnSettings):
        self.inner, self.tokenizer, self.make_episode, self.settings = inner, tokenizer, make_episode, settings
        self.name = inner.name
        self._engine_logps = True  # every turn's batch carried the engine's log-probs (kept as sample_logps)
        from prefzoo.environments.tools import template_supports_tools

        self.native = template_supports_tools(tokenizer)

    def sampling_model(self, model):
        return self.inner.sampling_model(model)

    def close(self) -> None:
        self.inner.close()

    # ------------------------------------------------------------------ episodes
    def _start(self, prompts: PromptBatch, num_samples: int) -> list[_Running]:
        messages = prompts.columns.get(PROMPT_MESSAGES)
        if messages is None:
            raise DataError("env=...: multi-turn episodes need conversational prompts (chat messages); this data's "
                            "prompts are plain text. Give the prompt column as a list of {role, content} messages.")
        seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
        rows = [{k: v[i] for k, v in prompts.columns.items() if k not in _NOT_ROW} for i in range(len(messages))]
        out = []
        for i, row in enumerate(rows):
            for j in range(num_samples):
                where = f"prompt {i + 1} of {len(rows)}, sample {j + 1}"
                with _episode_context(where, "its start"):
                    episode = self.make_episode()
                    first = episode.start({"prompt": messages[i], **row})  # TRL's reset(**row): every column
                msgs = copy.deepcopy(list(messages[i]))
                if first:
                    msgs[-1] = {**msgs[-1], "content": f"{msgs[-1]['content']}\n\n{first}"}
                text = render(self.tokenizer, msgs, episode.schemas, True, self.native)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                log = EpisodeLog(messages=[], answer="", environment=episode.instance,
                                 turn_rewards=[] if self.settings.reward_placement == "turn" else None)
                out.append(_Running(episode, msgs, ids, [], [], [], log,
                                    None if seeds is None else episode_seed(seeds[i], j, 0), where=where))
        return out

    @torch.no_grad()
    def sample(self, model, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
               eos_token_ids: list[int], pad_id: int, generator=None) -> SequenceBatch:
        """``num_samples`` episodes per prompt (module docstring); rows grouped by prompt."""
        runs = self._start(prompts, num_samples)
        s, eos = self.settings, set(eos_token_ids)
        self._engine_logps = True
        device = prompts.prompt_ids.device
        for turn in range(s.max_turns):
            active = [r for r in runs if not r.done]
            if not active:
                break
            budget = max(min(params.max_new_tokens, s.max_tokens - len(r.ids)) for r in active)
            rows = [r.prompt_ids + r.ids for r in active]
            width = max(len(x) for x in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
            mask = torch.zeros((len(rows), width), dtype=torch.bool, device=device)
            for k, x in enumerate(rows):
                ids[k, width - len(x):] = torch.tensor(x, dtype=torch.long, device=device)
                mask[k, width - len(x):] = True
            columns = {} if active[0].seed is None else {
                ROLLOUT_SEED_COLUMN: [episode_seed(r.seed, 0, turn) for r in active]}
            batch = self.inner.sample(model, PromptBatch(ids, mask, columns), 1, replace(params, max_new_tokens=budget),
                                      eos_token_ids=eos_token_ids, pad_id=pad_id, generator=generator)
            for k, r in enumerate(active):
                self._advance(r, batch, k, turn, eos)
        return self._collate(runs, prompts.prompt_ids.shape[0], num_samples, pad_id, device)

    def _advance(self, r: _Running, batch: SequenceBatch, k: int, turn: int, eos: set) -> None:
        """Take row k of one turn's samples into episode ``r``; ask its environment; extend or end it."""
        from prefzoo.environments.tools import parse_turn

        s = self.settings
        tokens = batch.completion_ids[k][batch.completion_mask[k]].tolist()[: s.max_tokens - len(r.ids)]
        self._engine_logps &= batch.sample_logps is not None
        logps = (batch.sample_logps[k][batch.completion_mask[k]].tolist()[: len(tokens)]
                 if batch.sample_logps is not None else [0.0] * len(tokens))
        prefix = render(self.tokenizer, r.messages, r.episode.schemas, True, self.native)
        r.ids += tokens
        r.policy += [True] * len(tokens)
        r.logps += logps
        r.log.turns += 1
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        message = parse_turn(self.tokenizer, text, prefix)
        message.setdefault("content", text)
        r.messages.append(message)
        r.log.messages.append(message)
        r.log.answer = text
        if not tokens or tokens[-1] not in eos:  # a turn cut at its length (or at the budget): the episode ends here
            r.done, r.log.cut = True, True
            return
        with _episode_context(r.where, f"turn {turn + 1}"):
            reply = r.episode.respond(text, message)
        r.log.tool_calls += reply.tool_calls
        r.log.tool_errors += reply.tool_errors
        if r.log.turn_rewards is not None and reply.reward is not None:  # on this turn's last token
            r.log.turn_rewards.append((len(r.ids) - 1, reply.reward))
        if reply.done:
            r.done = True
            return
        if turn == s.max_turns - 1:
            r.done, r.log.cut = True, True
            return
        env = environment_ids(self.tokenizer, reply.messages, r.episode.schemas, self.native)
        if len(r.ids) + len(env) + 1 > s.max_tokens:  # no room for the reply and one more policy token
            r.done, r.log.cut = True, True
            return
        r.ids += env
        r.policy += [False] * len(env)
        r.logps += [0.0] * len(env)
        r.messages += reply.messages
        r.log.messages += reply.messages

    def _collate(self, runs: list[_Running], n_prompts: int, num_samples: int, pad_id: int, device) -> SequenceBatch:
        for r in runs:
            with _episode_context(r.where, "its end"):
                r.log.env_reward = r.episode.reward()
        p_width = max(len(r.prompt_ids) for r in runs)
        c_width = max(1, max(len(r.ids) for r in runs))
        b = len(runs)
        prompt_ids = torch.full((b, p_width), pad_id, dtype=torch.long, device=device)
        prompt_mask = torch.zeros((b, p_width), dtype=torch.bool, device=device)
        completion_ids = torch.full((b, c_width), pad_id, dtype=torch.long, device=device)
        policy = torch.zeros((b, c_width), dtype=torch.bool, device=device)
        present = torch.zeros((b, c_width), dtype=torch.bool, device=device)
        sample_logps = torch.zeros((b, c_width), dtype=torch.float32, device=device)
        for k, r in enumerate(runs):
            p, c = len(r.prompt_ids), len(r.ids)
            prompt_ids[k, p_width - p:] = torch.tensor(r.prompt_ids, dtype=torch.long)
            prompt_mask[k, p_width - p:] = True
            if c:
                completion_ids[k, :c] = torch.tensor(r.ids, dtype=torch.long)
                policy[k, :c] = torch.tensor(r.policy)
                present[k, :c] = True
                sample_logps[k, :c] = torch.tensor(r.logps)
        return SequenceBatch(prompt_ids, prompt_mask, completion_ids, policy,
                             prompt_index=torch.arange(n_prompts, device=device).repeat_interleave(num_samples),
                             truncated=torch.tensor([r.log.cut for r in runs], device=device),
                             sample_logps=sample_logps if self._engine_logps else None,
                             token_mask=present, episodes=[r.log for r in runs])

