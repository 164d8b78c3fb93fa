"""Shared helpers of the benchmarks: config composition, realistic pairs and prompts, peak memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the interpreter of TRL's venv (``make setup-bench-trl``), or $TRL_PYTHON
TRL_PYTHON = Path(os.environ.get("TRL_PYTHON") or ROOT / "bench" / ".venv-trl" / "bin" / "python")


def run_trl_side(script: str, data: dict) -> tuple[dict | None, str]:
    """Run ``script --trl-side IN OUT`` under TRL's interpreter on ``data`` (JSON) and read its JSON answer.

    Returns (answer, "") or (None, a one-line reason: TRL's venv is missing, or the last line of its stderr)."""
    if not TRL_PYTHON.exists():
        return None, f"{TRL_PYTHON} is missing: `make setup-bench-trl` creates TRL's venv (or set TRL_PYTHON)."
    with tempfile.TemporaryDirectory() as tmp:
        infile, outfile = Path(tmp) / "in.json", Path(tmp) / "out.json"
        infile.write_text(json.dumps(data))
        proc = subprocess.run([str(TRL_PYTHON), script, "--trl-side", str(infile), str(outfile)],
                              capture_output=True, text=True, cwd=tmp)
        if proc.returncode:
            return None, proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "TRL's side failed"
        return json.loads(outfile.read_text()), ""


def trl_answer(script: str, data: dict) -> dict:
    """:func:`run_trl_side`'s answer, or the reason it has none printed and the comparison ended with status 2 (the
    comparisons' common opening)."""
    theirs, why = run_trl_side(script, data)
    if theirs is None:
        print(why)
        sys.exit(2)
    return theirs

STORY = ("Tom has {a} apples and buys {b} more at the market, then gives {c} of them to his sister, who "
         "already had {d}. His friend Anna brings {e} pears and asks how many pieces of fruit there are in total. ")
ANSWER = ("First, Tom starts with {a} apples. Buying {b} more gives {a} + {b} = {ab}. Giving away {c} leaves "
          "{ab} - {c} = {abc}. Anna's {e} pears make {abc} + {e} = {t} pieces of fruit. ")


def compose(overrides: list[str]):
    """The typed config for ``overrides``, exactly as ``train.py`` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from prefzoo.cli import register_configs, to_typed

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


def example_pair_texts(tokenizer, n: int, max_length: int, prompt_tokens: int = 100, completion_tokens: int = 118
                       ) -> list[dict]:
    """The pairs of :func:`example_pairs` as text ({"prompt", "chosen", "rejected"}; the prompt chat-templated, the
    completions without EOS): the form a third-party trainer (TRL) tokenises itself."""
    out = []
    for e in example_pairs(tokenizer, n, max_length, prompt_tokens, completion_tokens):
        out.append({"prompt": tokenizer.decode(e.prompt_ids), "chosen": tokenizer.decode(e.chosen_ids[:-1]),
                    "rejected": tokenizer.decode(e.rejected_ids[:-1])})
    return out


def tokenize_pair_like_trl(tokenizer, pair: dict):
    """A :class:`PreferenceExample` with exactly the token ids TRL's DPO trainer builds from ``pair``: prompt and
    prompt+completion+EOS tokenised separately, the completion starting where the two diverge."""
    from prefzoo.data.preference import PreferenceExample

    eos = tokenizer.eos_token
    ids = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    prompt = ids(pair["prompt"])
    chosen, rejected = ids(pair["prompt"] + pair["chosen"] + eos), ids(pair["prompt"] + pair["rejected"] + eos)

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    cut = min(common(prompt, chosen), common(prompt, rejected))
    return PreferenceExample(prompt[:cut], chosen[cut:], rejected[cut:])
