"""``python -m prefzoo.cli pairs``: the built-in pairs' command line, moved out of prefzoo/data/pairs.py.

It used to live in ``prefzoo.data.pairs.main``, which imported ``prefzoo.training.setup``, which imports
``prefzoo.data.pairs``: the package's one import circle. The old ``python -m prefzoo.data.pairs`` now fails
with a message naming the new command.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

from prefzoo import cli

ROOT = Path(__file__).resolve().parents[1]


def _prefzoo_imports(path: Path) -> set[str]:
    """Every prefzoo module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prefzoo"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("prefzoo")}
    return found


def test_data_pairs_imports_neither_the_training_setup_nor_the_cli():
    """The circle data.pairs -> training.setup -> data.pairs is gone (before the move data/pairs.py imported
    prefzoo.training.setup inside main); setup still imports data.pairs, one way."""
    pairs = _prefzoo_imports(ROOT / "prefzoo" / "data" / "pairs.py")
    assert not {m for m in pairs if m.startswith(("prefzoo.training", "prefzoo.cli"))}, pairs
    assert "prefzoo.data.pairs" in _prefzoo_imports(ROOT / "prefzoo" / "training" / "setup.py")


def test_the_old_command_names_the_new_one():
    proc = subprocess.run([sys.executable, "-m", "prefzoo.data.pairs"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "prefzoo: error: this command moved: run `python -m prefzoo.cli pairs [overrides]`"


def test_no_or_unknown_command_lists_the_commands(capsys):
    assert cli.main([]) == 2
    assert cli.main(["pears"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("prefzoo: error: python -m prefzoo.cli needs a command: pairs")
                                 for line in err)
    assert "'pears'" in err[1]


def test_bad_values_and_overrides_fail_in_one_line(capsys):
    assert cli.build_pairs(["model=tiny", "data.pairs.num_samples=1"]) == 2
    assert cli.build_pairs(["model=tiny", "data.nope=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert err[0].startswith("prefzoo: error: data.pairs.num_samples=1: a pair needs at least 2 samples")
    assert err[1].startswith("prefzoo: error: Could not override 'data.nope'")


def test_pairs_are_built_on_the_tiny_model_and_found_again(tmp_path, monkeypatch, capsys):
    """4 + 2 review prompts x 6 samples of the random tiny model, scored by the sentiment reward (continuous, so
    groups disagree): the command writes train.jsonl / eval.jsonl under $PREFZOO_CACHE/pairs, prints the stats it
    wrote to stats.json, and a second call finds the cache (same stats, same files)."""
    monkeypatch.setenv("PREFZOO_CACHE", str(tmp_path))
    args = ["model=tiny", "data=sentiment", "reward=sentiment", "data.pairs.num_prompts=4", "data.pairs.eval_prompts=2",
            "data.pairs.max_new_tokens=8", "data.pairs.require_finished=false", "trainer.device=cpu"]
    assert cli.build_pairs(args) == 0
    first = capsys.readouterr().out
    (folder,) = (tmp_path / "pairs").iterdir()
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["train"]["prompts"] == 4 and stats["train"]["samples"] == 24 and stats["eval"]["prompts"] == 2
    rows = (folder / "train.jsonl").read_text().splitlines()
    assert len(rows) == stats["train"]["pairs"] >= 1
    assert f"{len(rows)} train pairs" in first and str(tmp_path / "pairs") in first
    assert cli.build_pairs(args) == 0
    assert f"{len(rows)} train pairs" in capsys.readouterr().out
    assert (folder / "train.jsonl").read_text().splitlines() == rows
