"""Multi-turn rollouts (prefzoo.rollout.multiturn) with a scripted turn engine and SmolLM2's real tokenizer and chat
template: token in, token out; the environment's tokens and only they are tokenised from text; the masks; the budget.

The scripted engine writes each turn CHARACTER BY CHARACTER (one byte-level token per character): decoding such a turn
and encoding the text again merges the characters into SmolLM2's usual tokens, so a rollout that re-tokenised the
policy's turns would hand the loss other ids than were sampled.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from prefzoo.environments import episode_factory
from prefzoo.environments.contract import TextEpisode, ToolEpisode
from prefzoo.rollout.multiturn import MultiTurnEngine, MultiTurnSettings, environment_ids, episode_seed
from prefzoo.types import PROMPT_MESSAGES, ROLLOUT_SEED_COLUMN, PromptBatch, SamplingParams, SequenceBatch
from tests.bounds import U32
from tests.environments.envs import AdderEnv, GuessEnv
from tests.models.helpers import tokenizer

TOK = tokenizer()
EOS = TOK.eos_token_id
HEADER = TOK("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]


def char_ids(text: str) -> list[int]:
    """One token per character (byte-level BPE: a space is 'Ġ', a newline 'Ċ')."""
    ids = [TOK.convert_tokens_to_ids({" ": "Ġ", "\n": "Ċ"}.get(ch, ch)) for ch in text]
    assert TOK.decode(ids) == text, text
    return ids


def turn_of(context: list[int]) -> int:
    """Which policy turn a context asks for: the assistant headers in it, minus one."""
    n = len(HEADER)
    return sum(context[i:i + n] == HEADER for i in range(len(context) - n + 1)) - 1


class ScriptedEngine:
    """An engine whose turn t is ``script[t]`` written character by character (+ EOS unless ``no_eos``), for every
    row; it records the contexts it was given and the seeds."""

    name = "hf"

    def __init__(self, script: list[str], no_eos: tuple[int, ...] = ()):
        self.script, self.no_eos, self.contexts, self.seeds = script, no_eos, [], []

    def sample(self, model, prompts, num_samples, params, *, eos_token_ids, pad_id, generator=None):
        assert num_samples == 1
        rows = []
        for ids, mask in zip(prompts.prompt_ids, prompts.prompt_mask):
            context = ids[mask].tolist()
            self.contexts.append(context)
            t = turn_of(context)
            turn = char_ids(self.script[min(t, len(self.script) - 1)]) + ([] if t in self.no_eos else [EOS])
            rows.append(turn[: params.max_new_tokens])
        self.seeds.append(prompts.columns.get(ROLLOUT_SEED_COLUMN))
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), pad_id)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for k, r in enumerate(rows):
            out[k, :len(r)], mask[k, :len(r)] = torch.tensor(r), True
        truncated = torch.tensor([not r or r[-1] != EOS for r in rows])
        return SequenceBatch(prompts.prompt_ids, prompts.prompt_mask, out, mask, torch.arange(len(rows)), truncated)

    def close(self):
        pass


def prompts(n: int = 1, answer: int = 5, seeds=None) -> PromptBatch:
    msgs = [[{"role": "user", "content": f"What is 2 + {answer - 2}?"}] for _ in range(n)]
    cols = {PROMPT_MESSAGES: msgs, "prompt_text": ["x"] * n, "answer": [answer] * n}
    if seeds is not None:
        cols[ROLLOUT_SEED_COLUMN] = seeds
    return PromptBatch(torch.zeros((n, 1), dtype=torch.long), torch.ones((n, 1), dtype=torch.bool), cols)


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def run(script, make_episode, n=1, k=1, settings=MultiTurnSettings(4, 400), no_eos=(), max_new_tokens=200, seeds=None):
    inner = ScriptedEngine(script, no_eos)
    engine = MultiTurnEngine(inner, TOK, make_episode, settings)
    batch = engine.sample(None, prompts(n, seeds=seeds), k, SamplingParams(max_new_tokens=max_new_tokens),
                          eos_token_ids=[EOS], pad_id=TOK.pad_token_id)
    return batch, inner


def test_three_turns_keep_the_sampled_ids_and_tokenise_only_the_environments_text():
    """An episode of TRL's AdderEnv over three policy turns (two tool calls, then the answer). Expected, row 0:
    the completion is turn 1's character ids + the template's tool-message ids for "5" + turn 2's ids + the tool
    message again + turn 3's ids, each policy turn ending in EOS; completion_mask is True exactly on the three turns;
    token_mask on every token. Each turn's ids differ from its text encoded again (the round trip merges characters),
    so this equality can only hold if no policy turn was re-tokenised. The environment's ids are the template's suffix
    after an assistant turn: "\\n<|im_start|>tool\\n5<|im_end|>\\n<|im_start|>assistant\\n"."""
    script = [CALL, CALL, "The answer is 5."]
    batch, inner = run(script, lambda: ToolEpisode(AdderEnv()))
    turns = [char_ids(t) + [EOS] for t in script]
    tool = TOK("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert environment_ids(TOK, [{"role": "tool", "name": "add", "content": "5"}], [], False) == tool
    want = turns[0] + tool + turns[1] + tool + turns[2]
    row = batch.completion_ids[0][batch.token_mask[0]].tolist()
    assert row == want
    policy = batch.completion_ids[0][batch.completion_mask[0]].tolist()
    assert policy == turns[0] + turns[1] + turns[2]
    for t in script:  # the round trip changes every turn's ids
        assert TOK(t, add_special_tokens=False)["input_ids"] != char_ids(t)
    expected_mask = [True] * len(turns[0]) + [False] * len(tool) + [True] * len(turns[1]) + [False] * len(tool) + \
        [True] * len(turns[2])
    assert batch.completion_mask[0, :len(want)].tolist() == expected_mask
    assert batch.token_mask[0].sum() == len(want)
    log = batch.episodes[0]
    assert (log.turns, log.tool_calls, log.tool_errors, log.cut) == (3, 2, 0, False)
    assert log.answer == "The answer is 5." and log.env_reward == 1.0 + 0.5 * 2  # AdderEnv.get_reward: 2 calls
    assert [m["role"] for m in log.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert log.messages[1]["content"] == "5"
    # the context of turn 3 is the prompt followed by exactly the ids so far
    prompt = batch.prompt_ids[0][batch.prompt_mask[0]].tolist()
    assert inner.contexts[-1] == prompt + turns[0] + tool + turns[1] + tool
    # reset's text was appended to the question, the tools described in the system message
    text = TOK.decode(prompt)
    assert "What is 2 + 3?\n\nYou may use the add tool." in text and '"name": "add"' in text


def test_a_text_environment_answers_with_user_messages_and_adds_its_step_rewards():
    """GuessEnv (answer 5): guesses 3, 9, 5. Expected: two feedback messages ("higher", "lower") as user turns, the
    episode ends at the right guess (done, not cut), reward -0.1 - 0.1 + 1 = 0.8."""
    batch, _ = run(["3", "9", "5"], lambda: TextEpisode(GuessEnv()))
    log = batch.episodes[0]
    assert [m["content"] for m in log.messages if m["role"] == "user"] == ["higher", "lower"]
    # float64 (Python floats): -0.1 - 0.1 + 1 rounds at ~1e-16; 1e-12 leaves 1e4x (kind 1)
    assert (log.turns, log.cut) == (3, False) and log.env_reward == pytest.approx(0.8, rel=1e-12)


def test_step_rewards_are_recorded_on_the_turn_they_reward():
    """The same GuessEnv episode with env.reward_placement=turn. Each guess is 2 tokens (the digit, EOS), each feedback
    the template's user-message suffix (L1 tokens for "higher", L2 for "lower"). Expected: (1, -0.1) after turn 1,
    (3 + L1, -0.1) after turn 2, (5 + L1 + L2, 1.0) after turn 3 -- each an EOS the policy wrote; the dense tensor sums
    to the episode's reward 0.8. With the default placement nothing is recorded per turn."""
    batch, _ = run(["3", "9", "5"], lambda: TextEpisode(GuessEnv()), settings=MultiTurnSettings(4, 400, "turn"))
    l1, l2 = (len(environment_ids(TOK, [{"role": "user", "content": w}], [], False)) for w in ("higher", "lower"))
    log = batch.episodes[0]
    assert [p for p, _ in log.turn_rewards] == [1, 3 + l1, 5 + l1 + l2]
    assert [r for _, r in log.turn_rewards] == [-0.1, -0.1, 1.0]  # the environment's own floats: exact
    for position, _ in log.turn_rewards:
        assert batch.completion_mask[0, position] and batch.completion_ids[0, position] == EOS
    # the dense tensor is float32 (kind 2): -0.1 rounded twice (u32 0.1 each) and two additions of partial sums of at
    # most 1.2 (the zeros add exactly): within 3 u32 x 1.2 = 2.1e-7 (approx's default, 1e-6 relative, was not derived)
    assert float(batch.turn_rewards().sum()) == pytest.approx(log.env_reward, rel=0, abs=3 * U32 * 1.2)
    assert log.env_reward == pytest.approx(0.8, rel=1e-12)
    default, _ = run(["3", "9", "5"], lambda: TextEpisode(GuessEnv()))
    assert default.episodes[0].turn_rewards is None and default.turn_rewards() is None


def test_the_budget_ends_episodes_on_a_policy_turn():
    """max_turns=2 with a policy that always calls: cut after its 2nd turn, no tool reply appended after it; a turn
    without EOS: cut there; max_tokens too small for the next reply: cut before it. Every trajectory's last token is
    the policy's."""
    batch, _ = run([CALL], lambda: ToolEpisode(AdderEnv()), settings=MultiTurnSettings(2, 400))
    log = batch.episodes[0]
    assert (log.turns, log.tool_calls, log.cut) == (2, 2, True) and bool(batch.truncated[0])
    last = int(batch.token_mask[0].sum()) - 1
    assert bool(batch.completion_mask[0, last]) and batch.completion_ids[0, last] == EOS
    batch, _ = run([CALL, "5"], lambda: ToolEpisode(AdderEnv()), no_eos=(0,))
    assert batch.episodes[0].turns == 1 and batch.episodes[0].cut and batch.episodes[0].tool_calls == 0
    short = len(char_ids(CALL)) + 5  # room for turn 1, not for the tool's reply and a token more
    batch, _ = run([CALL, "5"], lambda: ToolEpisode(AdderEnv()), settings=MultiTurnSettings(4, short))
    assert batch.episodes[0].turns == 1 and batch.episodes[0].cut
    assert int(batch.token_mask[0].sum()) == int(batch.completion_mask[0].sum()) == len(char_ids(CALL)) + 1


def test_failed_calls_are_observations_the_episode_goes_on():
    """An unknown tool, arguments that do not fit, a tool that raises, one past env.tool_timeout and one that returns
    None: each answered with {"error": ...} in a tool message, counted in tool_errors; the episode reaches its answer."""
    calls = ['<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
             '<tool_call>{"name": "fail", "arguments": {"reason": "no"}}</tool_call>',
             '<tool_call>{"name": "slow", "arguments": {"seconds": 2}}</tool_call>',
             '<tool_call>{"name": "nothing", "arguments": {"x": 1}}</tool_call>',
             "<tool_call>not json</tool_call>", "5"]
    batch, _ = run(calls, lambda: ToolEpisode(AdderEnv(), timeout=0.2), settings=MultiTurnSettings(8, 2000))
    log = batch.episodes[0]
    errors = [json.loads(m["content"])["error"] for m in log.messages if m["role"] == "tool"]
    assert (log.tool_calls, log.tool_errors, log.turns, log.cut) == (6, 6, 7, False)
    assert "unknown tool 'sub'" in errors[0] and "bad arguments for add" in errors[1]
    assert errors[2] == "ValueError: no" and "tool_timeout=0.2" in errors[3] and "returned a NoneType" in errors[4]
    assert "malformed tool call" in errors[5]


def test_episodes_are_grouped_by_prompt_and_seeded_per_episode_and_turn():
    """2 prompts x 3 samples: 6 rows, prompt_index [0,0,0,1,1,1]; turn t of sample j of a prompt seeded s draws from
    episode_seed(episode_seed(s, j, 0), 0, t): the same episode, turn and seed whatever else is in the batch."""
    batch, inner = run([CALL, "5"], lambda: ToolEpisode(AdderEnv()), n=2, k=3, seeds=[11, 12])
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    first = [episode_seed(episode_seed(s, j, 0), 0, 0) for s in (11, 12) for j in range(3)]
    second = [episode_seed(episode_seed(s, j, 0), 0, 1) for s in (11, 12) for j in range(3)]
    assert inner.seeds == [first, second] and len(set(first + second)) == 12


def test_a_calculator_episode_through_the_built_in_environment():
    """env=calculator's class: its tool evaluates the call's expression exactly (123 * 456 = 56088)."""
    make = episode_factory(SimpleNamespace(name="calculator", tool_timeout=5.0, turn_cost=0.0))
    calc = '<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'
    batch, _ = run([calc, "56088"], make)
    assert batch.episodes[0].messages[1] == {"role": "tool", "name": "calculator", "content": "56088"}


def test_a_skyrl_gym_environment_is_played_through_its_own_step():
    """skyrl-gym's GSM8kMultiTurnEnv (the installed package), built per episode from the row (ground truth = the
    answer, 5): turn "#### 4" is well formatted but wrong (reward 0.2 / 5 = 0.04 and its feedback as a user message),
    turn "#### 5" right (reward 1, done): the episode's environment reward 1.04."""
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    make = episode_factory(SimpleNamespace(name="custom", target="skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv",
                                           tool_timeout=5.0, turn_cost=0.0))
    batch, _ = run(["#### 4", "#### 5"], make)
    log = batch.episodes[0]
    assert isinstance(log.environment, GSM8kMultiTurnEnv)
    assert (log.turns, log.cut) == (2, False) and log.env_reward == pytest.approx(1.04, rel=1e-12)  # float64 (kind 1)
    assert log.messages[1]["role"] == "user" and "#### ANSWER" in log.messages[1]["content"]
