"""Built-in prompt tasks, generated from a seed: no download, no model, pure Python.

Two tasks ship with the library:

- :class:`ArithmeticTask`: arithmetic questions with an exact integer answer, for a verifiable
  reward (``correctness``, ``format`` in :mod:`prefzoo.rewards`), the GRPO setting of
  Shao et al. 2024 (DeepSeekMath) on a toy scale.
- :class:`SentimentTask`: requests for a short review of a made-up film or product, for the
  "write positively" task of Ziegler et al. 2019 (Fine-Tuning Language Models from Human
  Preferences, Sec. 3), scored by the ``sentiment`` reward.

Each problem is a dict whose ``prompt`` is a list of chat messages
``[{"role": "user", "content": ...}]``. Splits are fixed by the seed: generation uses only
``random.Random(seed)`` (never ``hash()``), so the same arguments give the same problems on every
machine and Python run. The held-out (eval) split is drawn first, so it does not change when
``num_train`` changes, and a smaller ``num_eval`` gives a prefix of a larger one.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
from typing import Any

from prefzoo.errors import ConfigError

__all__ = [
    "PLAIN_INSTRUCTION",
    "WORD_PROBLEM_INSTRUCTION",
    "ARITHMETIC_OPS",
    "ArithmeticTask",
    "SentimentTask",
    "TASKS",
    "get_task",
]

#: Appended to a plain question ("What is 23 + 45?"). The ``format`` reward checks for it.
PLAIN_INSTRUCTION = "Reply with just the number."
#: Appended to a word problem. The ``format`` reward checks for it.
WORD_PROBLEM_INSTRUCTION = "Give the final answer as a number at the end."

#: Operators an :class:`ArithmeticTask` can use, written as they appear in plain questions.
ARITHMETIC_OPS = ("+", "-", "*")
_MAX_DIGITS = 4
_SPLITS = ("train", "eval")

# Word-problem templates. {a} and {b} are the operands in the order they are asked (for "-", a >= b),
# {name} a person, {item} a plural noun.
_WORD_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
        "A shop sold {a} {item} in the morning and {b} {item} in the afternoon. "
        "How many {item} did it sell in total?",
        "{name} collected {a} {item} on Monday and {b} {item} on Tuesday. "
        "How many {item} did {name} collect altogether?",
        "There are {a} {item} in one box and {b} {item} in another. "
        "How many {item} are there in both boxes together?",
    ),
    "-": (
        "{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?",
        "A basket holds {a} {item}. {name} takes {b} of them out. How many {item} are still in the basket?",
        "{name} needs {a} {item} and already has {b}. How many more {item} does {name} need?",
        "A store had {a} {item} and sold {b} of them. How many {item} does the store have left?",
    ),
    "*": (
        "{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in total?",
        "A shelf has {a} rows with {b} {item} in each row. How many {item} are on the shelf?",
        "{name} buys {a} packs of {item}, and each pack holds {b} {item}. How many {item} does {name} buy?",
        "Each of {a} children brings {b} {item}. How many {item} do the children bring altogether?",
    ),
}
_NAMES = ("Tom", "Ana", "Priya", "Kenji", "Omar", "Lena", "Sam", "Maya", "Diego", "Zoe")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps", "shells", "cards")

# Sentiment subjects: made-up film titles ("The Silver Harbor") and products ("Nimbus Pro desk lamp").
_TITLE_ADJECTIVES = (
    "Silver", "Crimson", "Hollow", "Last", "Quiet", "Broken", "Golden", "Northern", "Midnight", "Wandering",
    "Paper", "Glass", "Burning", "Forgotten", "Distant", "Velvet", "Iron", "Winter", "Hidden", "Electric",
)
_TITLE_NOUNS = (
    "Harbor", "Orchard", "Lantern", "Frontier", "Garden", "Signal", "Kingdom", "River", "Carnival", "Lighthouse",
    "Station", "Mirror", "Compass", "Tide", "Canyon", "Archive", "Circus", "Meadow", "Voyage", "Citadel",
)
_BRANDS = ("Nimbus", "Kestrel", "Solace", "Vantor", "Lumio", "Brightwell", "Orbix", "Tern", "Fathom", "Quill",
           "Corvo", "Marlow")
_VARIANTS = ("", "Pro ", "Mini ")
_PRODUCT_TYPES = (
    "wireless headphones", "coffee grinder", "hiking backpack", "desk lamp", "electric kettle", "running shoes",
    "smartwatch", "blender", "bluetooth speaker", "office chair", "water bottle", "robot vacuum",
)
_FILM_TEMPLATES = (
    "Write a short review of the film '{subject}'.",
    "Write a short review of the movie '{subject}' in two or three sentences.",
    "You just watched the film '{subject}'. Write a short review of it.",
)
_PRODUCT_TEMPLATES = (
    "Write a short review of the {subject}.",
    "Write a short customer review of the {subject} in two or three sentences.",
    "You just bought the {subject}. Write a short review of it.",
)


def _check_count(name: str, value: Any, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}; pass e.g. {name}=100.")
    return value


def _draw_new(rng: random.Random, size: int, taken: set[int]) -> int:
    """Draw uniformly from range(size) until an index not in ``taken`` comes up; add and return it.

    Drawing one index at a time (instead of ``rng.sample``) keeps a split a prefix of a larger one.
    The caller guarantees that at least one index is free.
    """
    while True:
        index = rng.randrange(size)
        if index not in taken:
            taken.add(index)
            return index


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}; pass e.g. seed=0.")
    return seed


def _user_message(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


class _GeneratedTask:
    """Shared split access: ``train()``, ``eval()``, ``to_dataset(split)``."""

    name: str = ""
    columns: tuple[str, ...] = ()
    _train: list[dict[str, Any]]
    _eval: list[dict[str, Any]]

    def train(self) -> list[dict[str, Any]]:
        """The training problems (a fresh copy each call)."""
        return copy.deepcopy(self._train)

    def eval(self) -> list[dict[str, Any]]:
        """The held-out problems (a fresh copy each call); none of them occurs in :meth:`train`."""
        return copy.deepcopy(self._eval)

    def split(self, split: str) -> list[dict[str, Any]]:
        """The problems of ``split`` ("train" or "eval").

        Raises:
            ConfigError: ``split`` is not one of "train", "eval".
        """
        if split == "train":
            return self.train()
        if split == "eval":
            return self.eval()
        raise ConfigError(f"unknown split {split!r} for task {self.name!r}; use one of {list(_SPLITS)}.")

    def to_dataset(self, split: str):
        """The problems of ``split`` as a ``datasets.Dataset``, one row per problem.

        Columns are the problem dict's keys (see the task class docstring); ``prompt`` holds the list
        of chat messages.

        Raises:
            ConfigError: ``split`` is not one of "train", "eval".
        """
        rows = self.split(split)
        import datasets  # imported here so that generating problems needs no third-party package

        if not rows:  # keep the columns of an empty split
            return datasets.Dataset.from_dict({column: [] for column in self.columns})
        return datasets.Dataset.from_list(rows)


class ArithmeticTask(_GeneratedTask):
    """Arithmetic questions with exact integer answers.

    Args:
        digits: digits per operand, 1..4; operands are drawn from [10**(digits-1), 10**digits - 1]
            (1..9 for one digit, 10..99 for two).
        ops: operators to use, a non-empty subset of ``("+", "-", "*")``; each problem uses one.
            Subtraction always has the larger operand first, so no answer is negative (it can be 0).
        num_train: number of training problems.
        num_eval: number of held-out problems.
        seed: fixes both splits.
        word_problems: True for templated stories ("Tom has 23 apples and buys 45 more. How many apples
            does Tom have now?") followed by :data:`WORD_PROBLEM_INSTRUCTION`; False for plain questions
            ("What is 23 + 45?") followed by :data:`PLAIN_INSTRUCTION`.

    Each problem is a dict with keys ``prompt`` (``[{"role": "user", "content": question + " " +
    instruction}]``), ``answer`` (int) and ``question`` (str, without the instruction).

    Every problem in both splits is a different arithmetic fact: no (operator, pair of operands) occurs
    twice, counting ``a + b`` and ``b + a`` (and ``a * b``, ``b * a``) as the same fact. So the eval split
    asks only sums, differences and products never seen in training, and no question text is shared.

    Raises:
        ConfigError: an argument is out of range, or ``num_train + num_eval`` exceeds the number of
            distinct facts (``len(ops) * m * (m + 1) / 2`` with ``m = 9 * 10**(digits-1)``; 45 per
            operator for one digit, 4095 for two).
    """

    name = "arithmetic"
    columns = ("prompt", "answer", "question")

    def __init__(
        self,
        digits: int = 2,
        ops: tuple[str, ...] | list[str] = ("+",),
        num_train: int = 2000,
        num_eval: int = 200,
        seed: int = 0,
        word_problems: bool = True,
    ) -> None:
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= _MAX_DIGITS:
            raise ConfigError(f"digits must be an integer from 1 to {_MAX_DIGITS}, got {digits!r}.")
        if isinstance(ops, str):
            ops = (ops,)
        ops = tuple(dict.fromkeys(ops))  # drop repeats, keep order
        bad = [op for op in ops if op not in ARITHMETIC_OPS]
        if not ops or bad:
            raise ConfigError(
                f"ops must be a non-empty list drawn from {list(ARITHMETIC_OPS)}, got {list(ops)!r}; "
                f"e.g. ops=['+', '-']."
            )
        self.digits = digits
        self.ops = ops
        self.num_train = _check_count("num_train", num_train)
        self.num_eval = _check_count("num_eval", num_eval)
        self.seed = _check_seed(seed)
        self.word_problems = bool(word_problems)
        self.instruction = WORD_PROBLEM_INSTRUCTION if self.word_problems else PLAIN_INSTRUCTION

        self._low = 10 ** (digits - 1)
        span = 9 * 10 ** (digits - 1)  # operands per position
        self._facts_per_op = span * (span + 1) // 2  # pairs (big, small) with big >= small
        capacity = len(ops) * self._facts_per_op
        if num_train + num_eval > capacity:
            raise ConfigError(
                f"ArithmeticTask(digits={digits}, ops={list(ops)}) has only {capacity} distinct problems, "
                f"but num_train + num_eval = {num_train + num_eval}; lower num_train/num_eval, or raise "
                f"digits or add ops."
            )

        rng = random.Random(seed)
        taken: set[int] = set()
        self._eval = [self._problem(rng, _draw_new(rng, capacity, taken)) for _ in range(num_eval)]
        self._train = [self._problem(rng, _draw_new(rng, capacity, taken)) for _ in range(num_train)]

    def _fact(self, index: int) -> tuple[str, int, int]:
        """Decode a fact index into (op, big, small), big >= small, by the triangular numbering
        index = t * (t + 1) / 2 + s with 0 <= s <= t."""
        op = self.ops[index // self._facts_per_op]
        k = index % self._facts_per_op
        t = (math.isqrt(8 * k + 1) - 1) // 2
        s = k - t * (t + 1) // 2
        return op, self._low + t, self._low + s

    def _problem(self, rng: random.Random, index: int) -> dict[str, Any]:
        op, a, b = self._fact(index)
        if op != "-" and rng.random() < 0.5:  # commutative: ask either order
            a, b = b, a
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        if self.word_problems:
            template = rng.choice(_WORD_TEMPLATES[op])
            question = template.format(a=a, b=b, name=rng.choice(_NAMES), item=rng.choice(_ITEMS))
        else:
            question = f"What is {a} {op} {b}?"
        return {
            "prompt": _user_message(f"{question} {self.instruction}"),
            "answer": answer,
            "question": question,
        }

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(digits={self.digits}, ops={self.ops}, num_train={self.num_train}, "
            f"num_eval={self.num_eval}, seed={self.seed}, word_problems={self.word_problems})"
        )


def _sentiment_pool() -> list[tuple[str, str]]:
    """Every (request text, subject) the sentiment task can ask, in a fixed order."""
    pool = []
    titles = [f"The {adj} {noun}" for adj in _TITLE_ADJECTIVES for noun in _TITLE_NOUNS]
    products = [f"{brand} {variant}{kind}" for brand in _BRANDS for variant in _VARIANTS for kind in _PRODUCT_TYPES]
    for subjects, templates in ((titles, _FILM_TEMPLATES), (products, _PRODUCT_TEMPLATES)):
        for subject in subjects:
            for template in templates:
                pool.append((template.format(subject=subject), subject))
    return pool


class SentimentTask(_GeneratedTask):
    """Requests for a short review of a made-up film or product (Ziegler et al. 2019, "write positively").

    Args:
        num_train: number of training prompts.
        num_eval: number of held-out prompts.
        seed: fixes both splits.

    Each problem is a dict with keys ``prompt`` (``[{"role": "user", "content": question}]``),
    ``question`` (the request, e.g. "Write a short review of the film 'The Silver Harbor'.") and
    ``subject`` (the film title or product, e.g. "The Silver Harbor"). There is no answer: the reward
    (``sentiment``) scores the completion alone.

    Subjects are 400 film titles and 432 products, each asked with one of three templates. The eval
    split's subjects never occur in the training split (held-out subjects, not just held-out wording).

    Raises:
        ConfigError: a count is negative, or the splits ask for more prompts than exist
            (``num_eval`` at most 2496; ``num_train`` at most 3 prompts per subject not held out).
    """

    name = "sentiment"
    columns = ("prompt", "question", "subject")

    def __init__(self, num_train: int = 1000, num_eval: int = 100, seed: int = 0) -> None:
        self.num_train = _check_count("num_train", num_train)
        self.num_eval = _check_count("num_eval", num_eval)
        self.seed = _check_seed(seed)
        pool = _sentiment_pool()
        if num_eval > len(pool):
            raise ConfigError(f"SentimentTask has {len(pool)} distinct prompts, but num_eval={num_eval}; lower it.")

        rng = random.Random(seed)
        taken: set[int] = set()
        eval_indices = [_draw_new(rng, len(pool), taken) for _ in range(num_eval)]
        held_out = {pool[i][1] for i in eval_indices}
        blocked = {i for i, (_, subject) in enumerate(pool) if subject in held_out}
        free = len(pool) - len(blocked)
        if num_train > free:
            raise ConfigError(
                f"SentimentTask(num_eval={num_eval}) leaves {free} prompts whose subject is not held out, "
                f"but num_train={num_train}; lower num_train or num_eval."
            )
        taken |= blocked
        train_indices = [_draw_new(rng, len(pool), taken) for _ in range(num_train)]
        self._eval = [self._problem(*pool[i]) for i in eval_indices]
        self._train = [self._problem(*pool[i]) for i in train_indices]

    @staticmethod
    def _problem(question: str, subject: str) -> dict[str, Any]:
        return {"prompt": _user_message(question), "question": question, "subject": subject}

    def __repr__(self) -> str:
        return f"SentimentTask(num_train={self.num_train}, num_eval={self.num_eval}, seed={self.seed})"


#: Task name -> class, for :func:`get_task` and configs.
TASKS: dict[str, type[_GeneratedTask]] = {"arithmetic": ArithmeticTask, "sentiment": SentimentTask}


def get_task(name: str, **kwargs: Any) -> ArithmeticTask | SentimentTask:
    """Build the built-in task called ``name`` ("arithmetic" or "sentiment") with ``kwargs``.

    Raises:
        ConfigError: ``name`` is not a built-in task (the message lists them), or a keyword is not an
            argument of that task (the message lists the accepted ones).
    """
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}.")
    cls = TASKS[name]
    signature = inspect.signature(cls)
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        accepted = ", ".join(signature.parameters)
        raise ConfigError(f"bad arguments for task {name!r}: {err}; it accepts: {accepted}.") from err
    return cls(**kwargs)
