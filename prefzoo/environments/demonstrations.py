"""Synthetic demonstrations of a tool-using episode, for a supervised warm start (``algo=sft`` on them, then RL from
that adapter): SmolLM2-135M-Instruct has never seen prefzoo's call format and, left alone, never calls a tool.

``python -m prefzoo.environments.demonstrations calculator demos.jsonl [N]`` writes, for N of the calculator task's
training problems (3-digit products, the data ``env=calculator`` trains on; held-out problems are never used), the two
policy turns of a correct episode as two rows of the standard conversational prompt/completion format (TRL's, what
``algo=sft data=file`` reads; the loss on the completion only):

1. prompt: the episode's first context -- the default format's system message describing the calculator, the question
   with the environment's hint appended, exactly as the rollout renders them; completion: the call
   ``<tool_call>{"name": "calculator", "arguments": {"expression": "a * b"}}</tool_call>``;
2. prompt: that context, the call and the tool's result; completion: the number alone.

Then: ``python train.py algo=sft data=file data.path=demos.jsonl`` and
``python train.py algo=grpo env=calculator model.adapter_path=<that run>/adapter``. (Before SFT read prompt/completion
rows, these were preference pairs with a wrong product as a ``rejected`` that SFT never read: the same prompts and
completions, the same SFT tokens and losses.)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from prefzoo.environments.builtin import CALCULATOR_HINT, CalculatorEnvironment
from prefzoo.environments.contract import ToolEpisode
from prefzoo.environments.tools import CALL_CLOSE, CALL_OPEN, default_tools_message

__all__ = ["calculator_demonstrations"]

_QUESTION = re.compile(r"What is (\d+) \* (\d+)\?")


def calculator_demonstrations(problems: list[dict]) -> list[dict]:
    """Two demonstration rows per problem (module docstring). ``problems``: the arithmetic task's rows (``prompt``
    messages, ``answer``, ``question`` "What is a * b?").

    Raises:
        ValueError: a question that is not a product "What is a * b?".
    """
    episode = ToolEpisode(CalculatorEnvironment())
    system = default_tools_message(episode.schemas)
    rows = []
    for problem in problems:
        match = _QUESTION.search(problem["question"])
        if match is None:
            raise ValueError(f"not a product question: {problem['question']!r}")
        expression = f"{match.group(1)} * {match.group(2)}"
        answer = int(problem["answer"])
        user = dict(problem["prompt"][-1])
        user["content"] = f"{user['content']}\n\n{CALCULATOR_HINT}"
        call = CALL_OPEN + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + CALL_CLOSE
        result = {"role": "tool", "name": "calculator", "content": str(answer)}
        context = [system, user]
        rows.append({"prompt": context, "completion": [{"role": "assistant", "content": call}]})
        rows.append({"prompt": [*context, {"role": "assistant", "content": call}, result],
                     "completion": [{"role": "assistant", "content": str(answer)}]})
    return rows


def main(argv: list[str] | None = None) -> int:
    from prefzoo.data.tasks import ArithmeticTask

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "calculator":
        print("usage: python -m prefzoo.environments.demonstrations calculator OUT.jsonl [N=300]", file=sys.stderr)
        return 2
    n = int(args[2]) if len(args) > 2 else 300
    # env=calculator's data (conf/env/calculator.yaml: digits 3, ops [*]) with the defaults' seed, sizes and form
    task = ArithmeticTask(digits=3, ops=["*"], num_train=2000, num_eval=200, seed=0, word_problems=False)
    problems = task.to_dataset("train").select(range(n))
    rows = calculator_demonstrations([dict(p) for p in problems])
    Path(args[1]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} demonstration rows ({n} problems x 2 turns) to {args[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
