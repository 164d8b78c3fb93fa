"""A user's own algorithm loads without editing prefzoo: by import path (algo=custom algo.target=...) and from an
installed package's entry point (group prefzoo.algorithms). The example is the README's (docs/examples/my_algos.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefzoo.algos import REGISTRY, get_algorithm, load_target
from prefzoo.errors import ConfigError, PluginError
from tests import background
from tests.test_cli import ROOT, TINY_RUN

EXAMPLES = ROOT / "docs" / "examples"


def env_with(extra_path: Path = EXAMPLES) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join([str(extra_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run(args: list[str], run_dir: Path, extra_path: Path = EXAMPLES) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          env=env_with(extra_path), capture_output=True, text=True, timeout=300)


def _custom_run(base: Path) -> background.Command:
    args = [a for a in TINY_RUN if not a.startswith("algo=")]
    return background.Command([sys.executable, "train.py", "algo=custom", "algo.target=my_algos:ChosenNLL",
                               "+algo.weight=0.5", *args, f"hydra.run.dir={base / 'run'}"], ROOT, env_with(), 300)


#: the README's plugin trained from the command line, in the background (tests/background.py)
CUSTOM_RUN = background.register("custom_algorithm_run", __name__, _custom_run)


def test_custom_algorithm_trains_the_tiny_model_from_the_command_line():
    """The README's 40-line plugin, named by import path, trains 2 steps on the tiny model: its loss is logged,
    its config (with the +algo.weight override) is recorded, the adapter is saved."""
    proc = CUSTOM_RUN.result()
    run_dir = proc.base / "run"
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["nll"] > 0 for r in rows)
    cfg = (run_dir / "config.yaml").read_text()
    assert "name: chosen_nll" in cfg and "target: my_algos:ChosenNLL" in cfg and "weight: 0.5" in cfg
    assert (run_dir / "adapter" / "adapter_config.json").is_file()


BAD = [
    (["algo=custom"], "algo=custom needs algo.target"),
    (["algo=custom", "algo.target=no_such_pkg.algos:X"], "module 'no_such_pkg' not found"),
    (["algo=custom", "algo.target=my_algos:Missing"], "has no attribute 'Missing'"),
    (["algo=custom", "algo.target=my_algos:ChosenNLLConfig"], "is not an algorithm plugin"),
    (["algo=custom", "algo.target=my_algos:ChosenNLL", "+algo.weight=-1"], "algo.weight=-1.0 must be > 0"),
    (["algo=custom", "algo.target=my_algos:ChosenNLL", "+algo.nope=1"], "algo.target=my_algos:ChosenNLL"),
]


def assert_one_error_line(returncode, stderr: str, needle: str) -> None:
    assert returncode == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefzoo: error:") and needle in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_custom_algorithms_fail_in_one_line(monkeypatch, capsys, args, needle):
    """In this process, through the CLI's entry point on the config ``train.py`` composes (what ``python train.py``
    runs after Hydra), the examples folder on the path as PYTHONPATH puts it there; nothing may be built."""
    from prefzoo import cli
    from prefzoo.models import loading
    from prefzoo.training import loop
    from tests.test_config import composed

    def tripwire(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded / the trainer was built before the refusal")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(loop, "load_tokenizer", tripwire)
    monkeypatch.setattr(loop, "Trainer", tripwire)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    registered = set(REGISTRY)
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.run_from_hydra(composed(*args, "model=tiny"))
    finally:
        for name in set(REGISTRY) - registered:  # load_target registers the plugin it loads
            REGISTRY.pop(name)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert_one_error_line(exit_.value.code, captured.err, needle)


def test_a_bad_custom_algorithm_fails_in_one_line_from_the_command_line(tmp_path):
    """The last of BAD through a real ``python train.py`` (Hydra's main, the exit status, stderr)."""
    args, needle = BAD[-1]
    proc = run([*args, "model=tiny"], tmp_path / "run")
    assert_one_error_line(proc.returncode, proc.stderr, needle)


def test_an_installed_entry_point_is_an_algorithm(tmp_path, monkeypatch):
    """A package that declares [project.entry-points."prefzoo.algorithms"] chosen_nll_ep = "my_algos:ChosenNLL"
    (here: its installed metadata, a .dist-info folder on sys.path) makes algo=chosen_nll_ep available."""
    dist = tmp_path / "my_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[prefzoo.algorithms]\nchosen_nll_ep = my_algos:ChosenNLL\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(REGISTRY, "chosen_nll_ep", raising=False)
    cls = get_algorithm("chosen_nll_ep")
    assert cls.__name__ == "ChosenNLL"
    REGISTRY.pop("chosen_nll_ep", None)
    REGISTRY.pop("chosen_nll", None)


def test_unknown_name_lists_builtins_and_custom():
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'; valid: .*dpo.*custom"):
        get_algorithm("nope")


def test_a_class_that_breaks_the_contract_is_refused(monkeypatch, tmp_path):
    (tmp_path / "broken_algos.py").write_text(
        "from prefzoo.algos import Algorithm\nclass NoDeclare(Algorithm):\n    name = 'x'\n"
        "    def loss(self, policy, batch, step):\n        return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="must implement declare"):
        load_target("broken_algos:NoDeclare")


def test_a_plugin_module_that_fails_on_import_is_one_line_naming_the_error_and_its_line(monkeypatch, tmp_path):
    """Hardening round 3, item 8: a module that raises while it is imported (here a NameError on its line 2) gave a
    traceback; now one ConfigError naming the target, the error and where it is."""
    (tmp_path / "broken_import.py").write_text("import math\nvalue = undefined_name + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_target("broken_import:Algo")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("algo.target='broken_import:Algo': importing module 'broken_import' failed with "
                              "NameError: name 'undefined_name' is not defined")
    assert f"({tmp_path / 'broken_import.py'}, line 2); fix the module." in message


def test_the_readme_shows_the_example_that_this_file_runs():
    """The README's 'Your own algorithm' code block is docs/examples/my_algos.py, verbatim."""
    readme = (ROOT / "README.md").read_text()
    assert (EXAMPLES / "my_algos.py").read_text() in readme
    assert len((EXAMPLES / "my_algos.py").read_text().splitlines()) <= 50
