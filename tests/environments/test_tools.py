"""Tools (prefzoo.environments.tools), the contracts' adapters (prefzoo.environments.contract) and the built-in
environments (prefzoo.environments.builtin), each against values worked out by hand."""

from __future__ import annotations

import json

import pytest

from prefzoo.environments.builtin import RETRY_FEEDBACK, CalculatorEnvironment, RetryEnvironment, evaluate_arithmetic
from prefzoo.environments.contract import TextEpisode, ToolEpisode, check_environment_class, episode_kind
from prefzoo.environments.tools import call_tool, parse_turn, tool_schema
from prefzoo.errors import ConfigError, DataError
from tests.environments import envs
from tests.models.helpers import tokenizer


@pytest.mark.parametrize("expression,value", [
    ("123 * 456", 56088), ("(2 + 3) * 4", 20), ("7 - 10", -3), ("-(4)", -4), ("10 / 4", 2.5), ("9 / 3", 3),
    ("1,000", None), ("735 x 149", 109515), ("2 * (3 + (4 - 1))", 12),
])
def test_the_calculator_evaluates_plain_arithmetic_exactly(expression, value):
    """Hand values: 123 * 456 = 56088, 735 * 149 = 109515; a division shows 2.5, or 3 when exact; 'x' reads as *."""
    if value is None:
        with pytest.raises(ValueError):
            evaluate_arithmetic(expression)
    else:
        assert evaluate_arithmetic(expression) == value and type(evaluate_arithmetic(expression)) is type(value)


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "not Call"), ("2 ** 10", "not BinOp"), ("a + 1", "not Name"),
    ("1 / 0", "division by zero"), ("'ab' * 3", "not Constant"), ("9" * 31 + " * 1", "more than 30 digits"),
    ("(1", "not an arithmetic expression"),
])
def test_anything_but_arithmetic_is_refused_never_evaluated(expression, why):
    with pytest.raises(ValueError, match=why.split(" ", 1)[1] if why.startswith("not ") else why):
        evaluate_arithmetic(expression)


def test_a_tools_schema_comes_from_its_hints_and_docstring():
    schema = tool_schema(envs.multiply)["function"]
    assert schema["name"] == "multiply" and schema["parameters"]["required"] == ["a", "b"]
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first integer"}
    with pytest.raises(ConfigError, match="no usable schema"):
        tool_schema(envs.UndocumentedTool().add)


def test_call_tool_runs_a_call_and_answers_every_failure_with_an_error():
    tools = {"multiply": envs.multiply}
    ok = call_tool({"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}, tools, 1.0)
    assert ok.error is None and ok.message == {"role": "tool", "name": "multiply", "content": "42"}
    as_text = call_tool({"function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}, tools, 1.0)
    assert as_text.message["content"] == "6"
    for call, why in [({"function": {"name": "divide", "arguments": {}}}, "unknown tool 'divide'"),
                      ({"function": {"name": "multiply", "arguments": [1, 2]}}, "must be an object"),
                      ({"function": {"name": "multiply", "arguments": {"a": 1, "c": 2}}}, "bad arguments"),
                      ({"function": "not json"}, "malformed tool call")]:
        result = call_tool(call, tools, 1.0)
        assert why in result.error and why in json.loads(result.message["content"])["error"]


def test_the_default_format_is_parsed_with_transformers_response_parsing():
    tok = tokenizer()
    message = parse_turn(tok, 'Let me compute. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
                         "")
    assert message["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert message["content"].strip() == "Let me compute."
    assert "tool_calls" not in parse_turn(tok, "The answer is 3.", "")


def test_the_contracts_are_told_apart_and_checked():
    assert episode_kind(envs.AdderEnv) == "tools" and episode_kind(envs.GuessEnv) == "text"
    assert check_environment_class(envs.AdderEnv, "x") == "tools"
    for cls, why in [(envs.NoReset, "has no reset"), (envs.NeedsArgs, "must take no argument"),
                     (envs.UndocumentedTool, "no usable schema"), (envs.NOT_A_CLASS, "not a class")]:
        with pytest.raises(ConfigError, match=why):
            check_environment_class(cls, "env.target=x")


def test_a_trl_environment_is_reset_with_the_row_and_owns_its_reward():
    """AdderEnv: reset(**row) gets the columns and returns the hint; the tools are its public methods (not reset,
    get_reward, or _private); get_reward after one call is 1 + 0.5 = 1.5."""
    episode = ToolEpisode(envs.AdderEnv())
    assert episode.start({"answer": 5, "prompt": []}) == "You may use the add tool."
    assert sorted(episode.tools) == ["add", "fail", "nothing", "slow"]
    reply = episode.respond("", {"tool_calls": [{"type": "function", "function": {"name": "add",
                                                                                     "arguments": {"a": 2, "b": 3}}}]})
    assert reply.messages == [{"role": "tool", "name": "add", "content": "5"}] and not reply.done
    assert episode.respond("5", {"content": "5"}).done and episode.reward() == 1.5


def test_a_text_environment_of_the_wrong_shape_is_one_line():
    class Bad:
        def reset(self):
            return 3

        def step(self, text):
            return "obs"

    with pytest.raises(DataError, match="must be a string or None"):
        TextEpisode(Bad()).start({})
    episode = TextEpisode(type("B", (), {"reset": lambda self: None, "step": lambda self, t: "obs"})())
    episode.start({})
    with pytest.raises(DataError, match=r"must return \(observation, reward, done\)"):
        episode.respond("x", {})


def test_retry_says_wrong_then_ends_at_the_right_answer_charging_its_turn_cost():
    """Answer 68, turn cost 0.25: "60" -> feedback, cost 0 (first attempt free); "sixty-eight 68" -> done, -0.25."""
    env = type("R", (RetryEnvironment,), {"turn_cost": 0.25})()
    env.reset(answer=68)
    assert env.step("60") == (RETRY_FEEDBACK, 0.0, False)
    assert env.step("it is 68") == (None, -0.25, True)


def test_env_retrys_episodes_pickle_with_their_turn_cost():
    """env=retry env.turn_cost=0.25 through the run's factory: the episode's instance pickles (the asynchronous worker
    sends it to the trainer with its rollout) and keeps its cost: after a wrong answer, the right one costs -0.25.
    Before: PicklingError (the factory made a subclass at run time, which pickle cannot find by name)."""
    import pickle
    from types import SimpleNamespace

    from prefzoo.environments import episode_factory

    episode = episode_factory(SimpleNamespace(name="retry", tool_timeout=5.0, turn_cost=0.25))()
    episode.start({"answer": 68})
    env = pickle.loads(pickle.dumps(episode.instance))
    assert env.step("60") == (RETRY_FEEDBACK, 0.0, False) and env.step("68") == (None, -0.25, True)


def test_the_calculator_environment_counts_its_calls():
    env = CalculatorEnvironment()
    assert "calculator" in env.reset(answer=1)
    assert env.calculator("12 * 12") == "144" and env.calls == 1
