"""The model card (the ecosystem-fit issue, item 2): ``adapter/README.md`` is a real card, as peft / TRL write one --
base model, algorithm, objective, data, steps, the evaluation before/after with standard errors, the command that
made the run, library versions -- written at the end of a run and again after a resume. Read back here and
compared with the run's own files (summary.json, .hydra/overrides.yaml), not with prefzoo's card code."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
import yaml

import prefzoo
from tests.models.helpers import threads
from tests.shared_runs import RUN


def card_parts(path):
    """(front matter dict, body text, {metric: (before, before_se, after, after_se)}) of a card: the yaml between
    the leading ``---`` lines, and the rows ``| metric | value ± se | value ± se |`` of its evaluation table."""
    text = path.read_text()
    match = re.match(r"---\n(.*?)\n---\n(.*)", text, flags=re.S)
    assert match, text[:300]
    front, body = yaml.safe_load(match.group(1)), match.group(2)
    table = body.split("## Evaluation", 1)[1].split("\n## ", 1)[0]

    def cell(text):
        text = text.strip().strip("`")
        if text in ("", "—"):
            return None, None
        value, _, se = text.partition("±")
        return float(value), (float(se) if se.strip() else None)

    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (*cell(cells[1]), *cell(cells[2]))
    return front, body, rows


def check_card(run_dir, overrides):
    """The card of ``run_dir`` against its summary.json and .hydra/overrides.yaml (see the module docstring)."""
    import peft
    import torch
    import transformers

    summary = json.loads((run_dir / "summary.json").read_text())
    front, body, rows = card_parts(run_dir / "adapter" / "README.md")
    assert front["library_name"] == "peft" and {"prefzoo", summary["algo"], "lora"} <= set(front["tags"])
    assert "base_model" not in front  # the tiny random model is no hub model (rebuilt by prefzoo.load_policy)
    assert "model=tiny" in body and "prefzoo.load_policy" in body
    # the objective, the steps, the data, as summary.json records them
    assert f"β = {summary['beta']}" in body and f"divergence `{summary['divergence']}`" in body
    assert f"KL estimator `{summary['kl_estimator']}`" in body
    assert re.search(rf"\*\*Steps:\*\* {summary['steps']} \(stopped by {summary['stop_reason']}\)", body)
    assert f"`{summary['algo']}`" in body and "data=file" in body and "arithmetic_pairs.jsonl" in body
    # every row of the evaluation table is summary.json's number printed with 4 decimals: within half a unit of the
    # 4th decimal, 5e-5 (kind 1 of tests/bounds.py: the printing's rounding; parsing it back adds ~1e-17)
    before, after = summary["eval_before"], summary["eval_after"]
    for key in ("task_accuracy", "task_reward", "preference_accuracy", "kl_k1", "entropy"):
        assert key in rows, (key, sorted(rows))
    for key, (b, b_se, a, a_se) in rows.items():
        assert b == pytest.approx(before[key], abs=5e-5) and a == pytest.approx(after[key], abs=5e-5), key
        for got, src in ((b_se, before), (a_se, after)):
            if f"{key}_se" in src:
                assert got == pytest.approx(src[f"{key}_se"], abs=5e-5), key
            else:
                assert got is None, key
    assert f"{after['n_problems']} held-out prompts" in body
    # the command, from the overrides Hydra-style saved in the run folder, and the library versions
    saved = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    assert saved == overrides
    assert f"prefzoo train {shlex.join(overrides)}" in body
    for name, version in (("PyTorch", torch.__version__), ("Transformers", transformers.__version__),
                          ("PEFT", peft.__version__), ("prefzoo", prefzoo.__version__)):
        assert f"- {name}: {version}" in body, name
    return summary, rows


@pytest.mark.slow  # ~25 s: a 2-step tiny DPO run with 2 evaluations, then 1 more step resumed, 1 more evaluation
def test_the_card_holds_the_runs_numbers_and_is_rewritten_after_a_resume(tmp_path, tiny_api_run):
    """Expected: after 2 steps the card's evaluation table is summary.json's eval_before / eval_after (values and
    standard errors), its objective summary.json's beta / divergence / estimator, its steps 2, its command the
    overrides of .hydra/overrides.yaml; after ``trainer.resume=true trainer.max_steps=3`` in the same folder, the
    card says 3 steps, its "after" column is the new summary's (a different evaluation: its KL differs), and its
    command is the resuming one. Before: peft's template ("# Model Card for Model ID", base_model '', no table)."""
    _, _, first_dir = tiny_api_run  # the session's prefzoo.train(RUN) (tests/shared_runs.py), read only
    first = RUN
    summary, rows = check_card(first_dir, first)
    assert summary["steps"] == 2
    (quick_start, *_) = re.findall(r"```python\n(.*?)```", (first_dir / "adapter" / "README.md").read_text(),
                                   flags=re.S)
    with threads(1):
        exec(compile(quick_start, "adapter/README.md", "exec"), {})  # noqa: S102 (the card's own snippet runs)
    run_dir = tmp_path / "run"
    shutil.copytree(first_dir, run_dir)  # resumed in a copy: the session's run stays as it was
    again = [o for o in first if not o.startswith("trainer.max_steps=")] + ["trainer.max_steps=3", "trainer.resume=true"]
    with threads(1):
        prefzoo.train(again, run_dir=run_dir)
    resumed, rows_after = check_card(run_dir, again)
    assert resumed["steps"] == 3
    assert rows_after["kl_k1"][2] != pytest.approx(rows["kl_k1"][2], abs=1e-4)  # the new "after" evaluation (a claim:
    # the new evaluation moved the printed KL by more than one printed unit, not a tolerance)
    assert rows_after["kl_k1"][0] == rows["kl_k1"][0]  # the same "before" (eval_before.json is kept on resume)


@pytest.mark.parametrize("name,base", [("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                       ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")])
def test_a_hub_base_model_is_named_in_the_header(tmp_path, name, base):
    """A card for a hub base model (built from a config and a summary.json-like dict, no run): its YAML header names
    the hub id as base_model, with the Hub's adapter tag, and the body gives the peft-only loading line."""
    from prefzoo.algos.dpo import DPOConfig
    from prefzoo.config import Config, ModelConfig
    from prefzoo.training.model_card import model_card

    cfg = Config(algo=DPOConfig(), model=ModelConfig(name=name))
    summary = {"algo": "dpo", "beta": 0.1, "final_beta": 0.1, "divergence": "reverse_kl", "kl_estimator": "k1",
               "kl_placement": "in_reward", "steps": 3, "stop_reason": "max_steps", "eval_before": None,
               "eval_after": {"n_problems": 8, "task_accuracy": 0.25, "task_accuracy_se": 0.1}}
    text = model_card(cfg, tmp_path / "run", tmp_path / "run" / "adapter", summary)
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["base_model"] == base and f"base_model:adapter:{base}" in front["tags"]
    assert f'AutoModelForCausalLM.from_pretrained("{base}")' in text
    _, _, rows = card_parts_of(text)
    assert rows["task_accuracy"] == (None, None, 0.25, 0.1)


def card_parts_of(text: str):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "README.md"
        path.write_text(text)
        return card_parts(path)
