"""The environments that ship with prefzoo (``env=retry``, ``env=calculator``), written to the same contracts a user's
are (:mod:`prefzoo.environments.contract`): ``retry`` is a text environment (``reset`` / ``step``), ``calculator`` a
TRL ``environment_factory`` class whose one tool is a calculator.

Both play on the arithmetic task's rows (``answer``: the exact integer). The run's reward functions (``correctness``
by default) score the final answer -- the last policy turn -- as in a single-turn run; an environment's own reward adds
to that (TRL's rule, weight 1): ``retry``'s is minus ``env.turn_cost`` per attempt after the first.
"""

from __future__ import annotations

import ast
import operator

from prefzoo.text import extract_final_number

__all__ = ["RetryEnvironment", "CalculatorEnvironment", "evaluate_arithmetic", "RETRY_FEEDBACK", "CALCULATOR_HINT"]

#: what ``retry`` says after a wrong answer
RETRY_FEEDBACK = "That is not right. Try again: reply with just the number."
#: what ``calculator`` appends to the question (its reset's text)
CALCULATOR_HINT = ("You have a calculator: call it with an arithmetic expression, read its result, then reply with "
                   "just the number.")


class RetryEnvironment:
    """Arithmetic with feedback (or any task with numeric answers: a reasoning-gym task such as ``chain_sum`` played
    over several turns, ``data=reasoning_gym data.task=chain_sum env=retry``): the policy answers; a right answer ends the episode, a wrong one is answered with
    :data:`RETRY_FEEDBACK` and the policy tries again, up to ``env.max_turns`` attempts (the rollout's budget).

    Reward (``step``'s, summed): ``-turn_cost`` for every attempt after the first (``env.turn_cost``, default 0), so
    with the run's ``correctness`` on the final answer an episode is worth ``1{right} - turn_cost * (attempts - 1)``.
    """

    turn_cost = 0.0  # set by the builder from env.turn_cost

    def reset(self, answer, **row) -> None:
        try:
            self.answer = int(float(answer))
        except (TypeError, ValueError):
            raise ValueError(f"env=retry checks numeric answers (arithmetic, reasoning-gym's chain_sum, "
                             f"letter_counting, ...); this task's answer {answer!r} is not a number") from None
        self.attempts = 0
        return None

    def step(self, text: str):
        self.attempts += 1
        cost = -self.turn_cost if self.attempts > 1 else 0.0
        if extract_final_number(text) == self.answer:  # the verifier's reading (correctness)
            return None, cost, True
        return RETRY_FEEDBACK, cost, False


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_DIGITS = 30  # results (and operands) longer than this are refused: no exponent towers through repeated *


def evaluate_arithmetic(expression: str):
    """The value of an arithmetic expression of numbers, ``+ - * /``, unary minus and parentheses, by a walk over its
    syntax tree (never ``eval``). Integers stay exact; a division gives a float, shown without a trailing ``.0``.

    Raises:
        ValueError: anything else (names, calls, powers, attributes, strings), a division by zero, or a number of
            more than 30 digits; the message says which.
    """
    try:
        tree = ast.parse(expression.replace("×", "*").replace("x", "*") if isinstance(expression, str) else "",
                         mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            value = _OPS[type(node.op)](left, right)
            if len(str(int(abs(value)))) > _MAX_DIGITS:
                raise ValueError("the result has more than 30 digits")
            return value
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {type(node).__name__}")

    value = walk(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


class CalculatorEnvironment:
    """Problems SmolLM2-135M cannot do in its head (``env=calculator``: 3-digit products) with a calculator tool.
    TRL's ``environment_factory`` contract: ``reset`` appends :data:`CALCULATOR_HINT` to the question; the tool is
    :meth:`calculator`; the final answer is scored by the run's reward functions (``correctness``)."""

    def reset(self, **row) -> str:
        self.calls = 0
        return CALCULATOR_HINT

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "123 * 45".
        """
        self.calls += 1
        return str(evaluate_arithmetic(expression))
