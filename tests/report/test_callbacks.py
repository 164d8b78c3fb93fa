"""The report wing's entry points outside a sweep: ``python -m prefzoo.report`` on a folder without runs, and the
Hydra callbacks (prefzoo.report.callbacks) of the recipes."""

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from prefzoo.report import callbacks

ROOT = Path(__file__).resolve().parents[2]


def test_train_first_runs_prefzoo_train_importable_from_this_checkout():
    """TrainFirst runs ``python -m prefzoo train`` (an installed wheel has no train.py), with this checkout first on
    PYTHONPATH so a clone without an install runs the same code (the folder two above callbacks.py: the root)."""
    assert callbacks.TRAIN_CMD == [sys.executable, "-m", "prefzoo", "train"]
    assert callbacks._env_importing_prefzoo()["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_report_of_a_folder_without_runs_is_one_line_and_exit_status_2(tmp_path):
    """Before: a SystemExit message without the ``prefzoo: error:`` prefix, exit status 1."""
    proc = subprocess.run([sys.executable, "-m", "prefzoo.report", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f"prefzoo: error: no summary.json under {tmp_path}: point `python -m prefzoo.report` "
                                   "at a run folder or a multirun folder (a run writes summary.json when it finishes).")


def test_write_report_callback_says_there_is_no_report_and_lets_the_sweep_end(tmp_path, capsys):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    callbacks.WriteReport().on_multirun_end(config)
    out = capsys.readouterr().out.strip()
    assert out.startswith("[prefzoo] no report: no summary.json under") and not (tmp_path / "report.md").exists()


def test_train_first_reuses_a_finished_run_named_by_reuse(tmp_path, monkeypatch, capsys):
    """``reuse_key`` (the recipes: ``reward.path``): when the folder it names holds a finished run, nothing is
    trained, whatever the sweep folder holds -- `+recipe=overoptimisation reward.path=<an algo=rm run>` reuses the
    proxy. Without it, or when it names an unfinished folder (the recipe's default, ``${hydra:sweep.dir}/reward_model``
    of a new sweep, resolved as in the jobs), the run is trained as before. Before: the proxy was trained again in
    every sweep (TrainFirst looked only in <sweep dir>/reward_model)."""
    ran = []
    monkeypatch.setattr(callbacks.subprocess, "run", lambda cmd, env: ran.append(cmd) or
                        type("Done", (), {"returncode": 0})())
    done = tmp_path / "old_sweep" / "reward_model"
    done.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    config = lambda path: OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "new_sweep")}},  # noqa: E731
                                            "reward": {"path": path}})
    first = lambda cfg, **kw: callbacks.TrainFirst(["algo=rm"], "reward_model", what="proxy",  # noqa: E731
                                                   **kw).on_multirun_start(cfg)
    first(config(str(done)), reuse_key="reward.path")
    assert ran == [] and f"[prefzoo] proxy: found {done}, not retrained" in capsys.readouterr().out
    first(config("${hydra:sweep.dir}/reward_model"), reuse_key="reward.path")
    first(config(str(done)))
    assert len(ran) == 2 and ran[0][-2] == f"hydra.run.dir={tmp_path / 'new_sweep' / 'reward_model'}"


def test_train_first_trains_one_prerequisite_per_swept_value(tmp_path, monkeypatch, capsys):
    """``per`` (recipes/overoptimisation_word.yaml: two proxies, ``per: data.pairs.seed``): one run per value the sweep
    gives the key -- from the command line (``data.pairs.seed=3,4``) before the recipe's own ``hydra.sweeper.params``
    (``0,1``), else the config's one value -- in ``<subdir>_<value>``, with ``{value}`` in ``per_overrides`` replaced;
    a finished ``<subdir>_<value>`` is not trained again."""
    ran = []
    monkeypatch.setattr(callbacks.subprocess, "run", lambda cmd, env: ran.append(cmd) or
                        type("Done", (), {"returncode": 0})())
    sweep = tmp_path / "sweep"

    def config(task, params):
        return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": task},
                                           "sweeper": {"params": params}}, "data": {"pairs": {"seed": 9}}})

    first = callbacks.TrainFirst(["algo=rm"], "reward_model", what="proxy", per="data.pairs.seed",
                                 per_overrides=["data.pairs.seed={value}", "trainer.seed={value}"])
    first.on_multirun_start(config([], {"data.pairs.seed": "0,1"}))
    assert [c[-4:] for c in ran] == [["data.pairs.seed=0", "trainer.seed=0", f"hydra.run.dir={sweep / 'reward_model_0'}",
                                      "hydra.output_subdir=null"],
                                     ["data.pairs.seed=1", "trainer.seed=1", f"hydra.run.dir={sweep / 'reward_model_1'}",
                                      "hydra.output_subdir=null"]]
    ran.clear()
    (sweep / "reward_model_3").mkdir(parents=True)
    (sweep / "reward_model_3" / "summary.json").write_text("{}")
    first.on_multirun_start(config(["algo=grpo", "data.pairs.seed=3,4"], {"data.pairs.seed": "0,1"}))
    assert len(ran) == 1 and ran[0][-2] == f"hydra.run.dir={sweep / 'reward_model_4'}"
    assert "found" in capsys.readouterr().out
    assert callbacks.swept_values(config([], {}), "data.pairs.seed") == ["9"]
    assert callbacks.swept_values(config(["data.pairs.seed=range(2,5)"], {}), "data.pairs.seed") == ["2", "3", "4"]
