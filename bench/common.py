"""Shared helpers of the benchmarks: config composition, realistic pairs and prompts, peak memory."""

from __future__ import annotations

import resource
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STORY = ("Tom has {a} apples and buys {b} more at the market, then gives {c} of them to his sister, who "
         "already had {d}. His friend Anna brings {e} pears and asks how many pieces of fruit there are in total. ")
ANSWER = ("First, Tom starts with {a} apples. Buying {b} more gives {a} + {b} = {ab}. Giving away {c} leaves "
          "{ab} - {c} = {abc}. Anna's {e} pears make {abc} + {e} = {t} pieces of fruit. ")


def compose(overrides: list[str]):
    """The typed config for ``overrides``, exactly as ``train.py`` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from prefzoo.config import register_configs, to_typed

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return to_typed(hydra_compose(config_name="config", overrides=overrides))


def _numbers(i: int) -> dict:
    a, b, c, d, e = 10 + 7 * i, 20 + 3 * i, 5 + i, 11 + 2 * i, 13 + 5 * i
    return {"a": a, "b": b, "c": c, "d": d, "e": e, "ab": a + b, "abc": a + b - c, "t": a + b - c + e}


def long_prompt(i: int, n_stories: int = 3) -> list[dict]:
    """A chat prompt of several word problems (about 100 tokens with SmolLM2's template)."""
    text = "".join(STORY.format(**_numbers(i + k)) for k in range(n_stories))
    return [{"role": "user", "content": text + "Answer the last question step by step."}]


def example_pairs(tokenizer, n: int, max_length: int, prompt_tokens: int = 100, completion_tokens: int = 118):
    """``n`` tokenised preference pairs of real text: prompts of ~``prompt_tokens`` tokens, completions of
    ~``completion_tokens`` (varying by a few tokens per pair, so padding is realistic), within ``max_length``."""
    from prefzoo.data.preference import PreferenceExample, prompt_text

    out = []
    for i in range(n):
        prompt = tokenizer(prompt_text(tokenizer, long_prompt(i)), add_special_tokens=False)["input_ids"]
        prompt = prompt[-prompt_tokens:]
        room = max_length - len(prompt)
        worked = "".join(ANSWER.format(**_numbers(i + k)) for k in range(6))
        chosen = tokenizer(worked, add_special_tokens=False)["input_ids"][: min(room, completion_tokens + 3 * (i % 3)) - 1]
        rejected = tokenizer(worked.replace("+", "-"), add_special_tokens=False)["input_ids"][: min(room, completion_tokens - 4 * (i % 2)) - 1]
        eos = tokenizer.eos_token_id
        out.append(PreferenceExample(prompt, chosen + [eos], rejected + [eos]))
    return out


def peak_rss_gb() -> float:
    """Peak resident memory of this process so far, in GB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
