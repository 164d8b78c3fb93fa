"""data=reasoning_gym: reasoning-gym tasks as prompt sets (prefzoo.data.reasoning_gym).

Deterministic splits, disjoint by index and by question, mixing in the weights' proportions, the prompts as chats,
bad input in one line, and no network. Before this module: ``data=reasoning_gym`` was no config choice (Hydra:
"Could not find 'data/reasoning_gym'") and ``prefzoo.data.reasoning_gym`` did not exist (ImportError).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from prefzoo.data.reasoning_gym import ReasoningGymTask, check_reward_choice
from prefzoo.errors import ConfigError, PrefzooError

ROOT = Path(__file__).resolve().parents[2]
SMALL_SUMS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}


def test_the_same_seed_gives_the_same_rows_and_another_seed_others():
    a = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=40, num_eval=10, seed=3)
    b = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=40, num_eval=10, seed=3)
    assert a.train() == b.train() and a.eval() == b.eval()
    c = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=40, num_eval=10, seed=4)
    assert [r["question"] for r in c.eval()] != [r["question"] for r in a.eval()]


def test_the_splits_share_no_index_and_no_question_and_the_held_out_split_is_a_prefix():
    """1-digit two-term sums and differences hold few distinct questions (10 x 10 operand pairs x 2 operators, at
    most 200), so among 300 training entries many repeat a held-out question: all are skipped. The entries' own
    ``source_index`` (reasoning-gym's) shows the held-out split is indices 0..49 and training starts after it; a
    smaller num_eval gives the first rows of the larger one."""
    one_digit = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    task = ReasoningGymTask("chain_sum", one_digit, num_train=300, num_eval=50, seed=0)
    held, train = task.eval(), task.train()
    held_idx = [json.loads(r["entry"])["metadata"]["source_index"] for r in held]
    train_idx = [json.loads(r["entry"])["metadata"]["source_index"] for r in train]
    assert held_idx == list(range(50)) and min(train_idx) >= 50 and len(set(train_idx)) == 300
    assert not {r["question"] for r in held} & {r["question"] for r in train}
    assert max(train_idx) > 50 + 300 - 1  # some entries were skipped as held-out questions
    smaller = ReasoningGymTask("chain_sum", one_digit, num_train=5, num_eval=20, seed=0)
    assert smaller.eval() == held[:20]


def test_too_few_distinct_questions_is_one_line_naming_the_settings():
    """Two-term 1-digit chain sums have at most 200 distinct questions: 150 held out leave too few for 400."""
    one_digit = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    with pytest.raises(ConfigError, match="data.num_train=400") as err:
        ReasoningGymTask("chain_sum", one_digit, num_train=400, num_eval=150)
    assert "\n" not in str(err.value)


def test_a_mixed_dataset_draws_each_task_in_proportion_to_its_weight():
    """Weights 2:1:1 over chain_sum, letter_counting, basic_arithmetic: each row's task is drawn independently
    (reasoning-gym's composite: rng.choices per index), so over N = 2000 rows the count of a task of probability p is
    Binomial(N, p), mean N p, standard deviation sqrt(N p (1 - p)): 1000 +- 22.4 for p = 1/2, 500 +- 19.4 for p = 1/4.
    Tolerance: 4 standard deviations (a false alarm about once in 16,000 runs; the rows are fixed by the seed, so the
    test is deterministic). The task column is checked against the question's own wording."""
    tasks, weights = ["chain_sum", "letter_counting", "basic_arithmetic"], [2, 1, 1]
    mixed = ReasoningGymTask(tasks, SMALL_SUMS, weights, num_train=1800, num_eval=200, seed=0)
    rows = mixed.eval() + mixed.train()
    n = len(rows)
    assert n == 2000
    wording = {"chain_sum": "State the final answer to the following arithmetic problem",
               "letter_counting": "How many times does the letter", "basic_arithmetic": ""}
    for row in rows:
        assert row["question"].startswith(wording[row["task"]]) and json.loads(row["entry"])["metadata"][
            "source_dataset"] == row["task"]
        assert json.loads(row["task_config"]) == SMALL_SUMS.get(row["task"], {})
    for task, w in zip(tasks, weights):
        p = w / sum(weights)
        count = sum(r["task"] == task for r in rows)
        assert abs(count - n * p) < 4 * math.sqrt(n * p * (1 - p)), (task, count, n * p)


def test_prompts_are_chats_stating_the_answer_format():
    """tags: reasoning-gym's ``direct`` system prompt (it asks for <answer> tags), the question as the user message,
    the known answer as <answer>...</answer>; number: no system message, the question then "Reply with just the
    number.", the known answer bare. The chat template is applied as for arithmetic (tokenize_prompts)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from prefzoo.data.prompts import tokenize_prompts
    from tests.models.helpers import tokenizer

    tags = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=2, num_eval=1).eval()[0]
    assert tags["prompt"] == [{"role": "system", "content": SYSTEM_PROMPTS["direct"]},
                              {"role": "user", "content": tags["question"]}]
    assert tags["answer_completion"] == f"<answer>{tags['answer']}</answer>" and tags["answer_format"] == "tags"
    task = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=2, num_eval=1, answer_format="number")
    number = task.eval()[0]
    assert number["prompt"] == [{"role": "user", "content": number["question"] + " Reply with just the number."}]
    assert number["answer_completion"] == number["answer"]
    prompts = tokenize_prompts(task.to_dataset("eval"), tokenizer(), 256)
    assert prompts.texts[0] == tokenizer().apply_chat_template(number["prompt"], add_generation_prompt=True,
                                                               tokenize=False)
    assert set(prompts.columns) == {"question", "answer", "task", "task_config", "entry", "answer_format",
                                    "answer_completion"}
    own = ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=0, num_eval=1, system_prompt="Be brief.").eval()[0]
    assert own["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert ReasoningGymTask("chain_sum", SMALL_SUMS, num_train=0, num_eval=1, system_prompt="").eval()[0][
        "prompt"][0]["role"] == "user"


@pytest.mark.parametrize("kwargs, needle", [
    ({"task": "chainsum"}, "data.task='chainsum' is not a reasoning-gym task; did you mean chain_sum"),
    ({"task": "gsm_symbolic"}, "data.task=gsm_symbolic: prefzoo does not use this task: its generators are derived "
                               "from the GSM-Symbolic templates, licensed CC-BY-NC-ND 4.0"),
    ({"task": ["chain_sum", "gsm_symbolic"]}, "data.task[1]=gsm_symbolic: prefzoo does not use this task"),
    ({"task": "chain_sum", "task_config": {"max_term": 3}},
     "data.task_config.max_term=3: task 'chain_sum' has no setting 'max_term' (did you mean max_terms"),
    ({"task": "chain_sum", "task_config": {"chain_sum": {"min_terms": 0}}}, "min_terms must be positive"),
    ({"task": "chain_sum", "task_config": {"seed": 5}}, "data.task_config.seed=5: prefzoo sets the seed"),
    ({"task": ["chain_sum", "letter_counting"], "weights": [1.0]},
     "data.task_weights=[1.0] does not match data.task=['chain_sum', 'letter_counting']: give one weight per task"),
    ({"task": ["chain_sum", "letter_counting"], "weights": [1.0, 0.0]},
     "data.task_weights[1]=0.0 (task 'letter_counting') must be a positive number"),
    ({"task": ["chain_sum", "letter_counting"], "task_config": {"max_terms": 2}},
     "data.task_config.max_terms=2: with several tasks"),
    ({"task": ["chain_sum", "chain_sum"]}, "names chain_sum more than once"),
    ({"task": None}, "data=reasoning_gym needs data.task=<name>"),
    ({"task": "countdown", "answer_format": "number", "num_eval": 1, "num_train": 0, "task_config":
      {"min_numbers": 3, "max_numbers": 3}}, "data.answer_format=number: task 'countdown' answers"),
    ({"task": "chain_sum", "answer_format": "xml"}, "data.answer_format='xml' is not an answer format"),
])
def test_bad_input_is_one_line_naming_the_key_and_value(kwargs, needle):
    with pytest.raises(PrefzooError) as err:
        ReasoningGymTask(**{"num_train": 4, "num_eval": 2, **kwargs})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_data_reasoning_gym_is_refused_with_the_arithmetic_reward():
    with pytest.raises(ConfigError, match="choose reward=reasoning_gym"):
        check_reward_choice("reasoning_gym", "arithmetic")
    check_reward_choice("reasoning_gym", "reasoning_gym")


def test_the_config_composes_from_the_command_line():
    """reward=reasoning_gym brings data=reasoning_gym (conf/config.yaml: data follows reward) with the default task;
    data.task picks another (the default's keyed settings are then ignored), +data.task_config.KEY adds one of its
    arguments, data.task_config.chain_sum.KEY changes one of the default's; a list mixes."""
    from prefzoo.data.reasoning_gym import reasoning_gym_task
    from tests.algos.hydra_runs import compose

    cfg = compose(["reward=reasoning_gym"])
    assert (cfg.data.name, cfg.data.task, cfg.reward.functions) == ("reasoning_gym", "chain_sum", ["reasoning_gym"])
    assert cfg.data.answer_format == "number"
    small = {"num_train": 4, "num_eval": 2}
    cfg = compose(["reward=reasoning_gym", "data.task=basic_arithmetic", "+data.task_config.max_terms=2",
                   *[f"data.{k}={v}" for k, v in small.items()]])
    task = reasoning_gym_task(cfg.data)
    assert task.tasks == ["basic_arithmetic"] and task.configs == [{"max_terms": 2}]
    cfg = compose(["reward=reasoning_gym", "data.task_config.chain_sum.max_terms=3", "data.task=[chain_sum,gcd]",
                   "data.task_weights=[3,1]", *[f"data.{k}={v}" for k, v in small.items()]])
    task = reasoning_gym_task(cfg.data)
    assert task.tasks == ["chain_sum", "gcd"] and task.weights == [3.0, 1.0]
    assert task.configs == [{**SMALL_SUMS["chain_sum"], "max_terms": 3}, {}]


def test_the_documented_tasks_generate_and_verify_with_the_network_cut():
    """In a fresh process whose sockets refuse to connect (socket.connect and create_connection raise), reasoning-gym
    imports and the tasks docs/data.md names generate and score their own answers 1.0: nothing is downloaded. The
    import time is printed (about 2 s here: sympy, matplotlib)."""
    code = """
import socket, time
def refuse(*a, **k):
    raise OSError("network cut by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
start = time.perf_counter()
import reasoning_gym
print("import seconds", round(time.perf_counter() - start, 2))
from prefzoo.data.reasoning_gym import ReasoningGymTask
from prefzoo.rewards.reasoning_gym import reasoning_gym_accuracy
tasks = ["chain_sum", "basic_arithmetic", "letter_counting", "leg_counting", "gcd", "spell_backward", "countdown"]
config = {"countdown": {"min_numbers": 3, "max_numbers": 3}}
rows = ReasoningGymTask(tasks, config, num_train=70, num_eval=0).train()
assert {r["task"] for r in rows} == set(tasks), {r["task"] for r in rows}
cols = {k: [r[k] for r in rows] for k in ("task", "task_config", "entry", "answer_format")}
assert reasoning_gym_accuracy([""] * len(rows), [r["answer_completion"] for r in rows], **cols) == [1.0] * len(rows)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")
    print(proc.stdout)
