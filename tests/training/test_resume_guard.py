"""Resume refuses what would mix runs, says what it does, and runs no code from a checkpoint.

One prepared run (DPO on the tiny model, tests/fixtures/arithmetic_pairs.jsonl, 2 steps, a checkpoint after
each: ``checkpoints/step-000001`` and ``step-000002``) is copied into each test's folder, then resumed with
``trainer.resume=true`` and a changed setting through the Trainer (the CLI runs the same code: tests/
test_bad_inputs_runs.py).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from prefzoo.algos.simpo import SimPOConfig
from prefzoo.errors import ConfigError, PrefzooError
from prefzoo.training import checkpoint, loop
from prefzoo.training.checkpoint import STATE_FILE, complete_checkpoints
from prefzoo.training.metrics_log import read_metrics
from tests.training.test_resume import FIXTURE, config

LR, WARMUP = 5e-3, 1  # tests.training.test_resume.config: trainer.lr and trainer.warmup_steps


def quiet(cfg):
    cfg.eval.before = cfg.eval.after = False
    return cfg


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("prepared")
    loop.Trainer(quiet(config(max_steps=2, save_every=1)), run_dir).run()
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-000001", "step-000002"]
    return run_dir


@pytest.fixture
def run_dir(prepared, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(prepared, target)
    return target


def resumed(max_steps=2, **trainer):
    return quiet(config(resume=True, max_steps=max_steps, save_every=1, **trainer))


def metrics_text(run_dir: Path) -> str:
    return (run_dir / "metrics.jsonl").read_text()


# ------------------------------------------------------------------ item 6: what defines a run cannot change
def with_changes(cfg, **dotted):
    for key, value in dotted.items():
        *path, last = key.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return cfg


@pytest.mark.parametrize("changes,needles", [
    # before the fix: data.path -> the run continued on the other file (steps 3-4 of the new data, exit 0)
    ({"data__path": "OTHER"}, ["data.path: ", "(checkpoint)"]),
    # before the fix: RuntimeError "size mismatch for base_model.model.model.layers.0...lora_A.default.weight"
    ({"model__lora__r": 8}, ["model.lora.r: 4 (checkpoint) vs 8 (now)"]),
    ({"trainer__seed": 3}, ["trainer.seed: 0 (checkpoint) vs 3 (now)"]),
    ({"objective__beta": 0.3}, ["objective.beta: 0.1 (checkpoint) vs 0.3 (now)"]),
    ({"algo__loss_type": "ipo", "trainer__batch_size": 3}, ["algo.loss_type: 'sigmoid' (checkpoint) vs 'ipo' (now)",
                                                      "trainer.batch_size: 2 (checkpoint) vs 3 (now)"]),
])
def test_resume_with_a_changed_run_setting_is_refused_before_the_model_loads(run_dir, tmp_path, monkeypatch,
                                                                             changes, needles):
    """Each key named is run-defining (README, "Resuming"); the message names it with its two values."""
    if changes.get("data__path") == "OTHER":
        other = tmp_path / "other.jsonl"
        shutil.copy(FIXTURE, other)
        changes = {**changes, "data__path": str(other)}
    before = metrics_text(run_dir)
    monkeypatch.setattr(loop, "build_parts", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError) as err:
        loop.Trainer(with_changes(resumed(max_steps=4), **changes), run_dir).run()
    message = str(err.value)
    assert "\n" not in message and "trainer.resume=true" in message
    for needle in needles:
        assert needle in message
    assert metrics_text(run_dir) == before  # nothing was trained or truncated


def test_resume_with_another_algorithm_is_refused(run_dir):
    """Before the fix: DPO steps 1-2 then SimPO steps 3-4 in one metrics.jsonl, exit 0."""
    cfg = resumed(max_steps=4)
    cfg.algo = SimPOConfig()
    with pytest.raises(ConfigError, match=r"algo\.name: 'dpo' \(checkpoint\) vs 'simpo' \(now\)"):
        loop.Trainer(cfg, run_dir).run()
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]


def test_settings_that_may_change_on_resume_are_accepted(run_dir):
    """max_steps, logging, eval and micro-batch settings are not run-defining: the run continues to step 3."""
    cfg = with_changes(resumed(max_steps=3, log_every=2), trainer__micro_batch_size=2, trainer__save_every=0)
    cfg.eval.every, cfg.eval.batch_size = 0, 2
    summary = loop.Trainer(cfg, run_dir).run()
    assert summary["steps"] == 3


def test_each_checkpoint_stores_the_run_defining_config(prepared):
    """checkpoints/step-N/run_config.json: the flat run-defining keys, without what may change on resume."""
    stored = json.loads((prepared / "checkpoints" / "step-000002" / "run_config.json").read_text())
    assert stored["algo.name"] == "dpo" and stored["model.lora.r"] == 4 and stored["trainer.lr"] == LR
    assert stored["data.path"] == FIXTURE
    for free in ("trainer.max_steps", "trainer.resume", "trainer.save_every", "eval.every", "trainer.device"):
        assert free not in stored


def test_a_checkpoint_without_run_config_resumes_with_a_warning(run_dir, caplog):
    """Checkpoints written before run_config.json existed: nothing to compare against, said in a warning."""
    for stored in (run_dir / "checkpoints").glob("step-*/run_config.json"):
        stored.unlink()
    with caplog.at_level(logging.WARNING):
        summary = loop.Trainer(resumed(max_steps=3), run_dir).run()
    assert summary["steps"] == 3
    assert any("has no run_config.json" in r.message for r in caplog.records)


def drop_from_run_config(run_dir: Path, key: str) -> None:
    """Make the checkpoints look as if written by a prefzoo that did not have ``key`` yet."""
    for stored in (run_dir / "checkpoints").glob("step-*/run_config.json"):
        saved = json.loads(stored.read_text())
        saved.pop(key)
        stored.write_text(json.dumps(saved))


def test_a_setting_added_since_the_checkpoint_at_its_default_is_accepted(run_dir, caplog):
    """A checkpoint of an earlier prefzoo lacks the settings added since (here rollout.kv_cache, added with the
    static cache). Before the fix: "rollout.kv_cache: '(absent)' (checkpoint) vs 'static' (now)", refused, so no
    run made before an upgrade could be resumed. At its default value the setting is the one the schema gives every
    run that does not set it: accepted, with a log line naming it."""
    drop_from_run_config(run_dir, "rollout.kv_cache")
    with caplog.at_level(logging.INFO):
        summary = loop.Trainer(resumed(max_steps=3), run_dir).run()
    assert summary["steps"] == 3
    assert any("rollout.kv_cache" in r.message and "default" in r.message for r in caplog.records)


def test_a_setting_added_since_the_checkpoint_set_away_from_its_default_is_refused(run_dir):
    """The same missing key set to a non-default value now: the checkpoint cannot say it ran that way: refused."""
    drop_from_run_config(run_dir, "rollout.kv_cache")
    cfg = resumed(max_steps=3)
    cfg.rollout.kv_cache = "dynamic"
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache: '\(absent\)' \(checkpoint\) vs 'dynamic' \(now\)"):
        loop.Trainer(cfg, run_dir).run()


def test_a_default_run_made_before_its_preset_was_named_resumes_as_rpo(tmp_path):
    """The default run (RPO: the DPO plugin with loss_type=[sigmoid, sft]) now records ``algo.preset: rpo``; its
    checkpoints of before have the same plugin and settings and no preset. The preset is a name: resuming is
    accepted, a changed loss is still refused. Failing value before: "algo.preset: '(absent)' (checkpoint) vs 'rpo'
    (now)", refused. (No model loads: the check runs on the two configs.)"""
    from prefzoo.algos.dpo import DPOConfig
    from prefzoo.training.resume import check_run_config, run_config

    old = config()
    old.algo = DPOConfig(loss_type=["sigmoid", "sft"])
    saved = {k: v for k, v in run_config(old).items() if k != "algo.preset"}  # as a checkpoint of before holds it
    now = config(resume=True)
    now.algo = DPOConfig(loss_type=["sigmoid", "sft"], preset="rpo")
    check_run_config(now, tmp_path, tmp_path / "checkpoints" / "step-000001", saved)
    now.algo = DPOConfig(loss_type="sigmoid", preset="rpo")
    with pytest.raises(ConfigError, match=r"algo\.loss_type: \['sigmoid', 'sft'\] \(checkpoint\) vs 'sigmoid'"):
        check_run_config(now, tmp_path, tmp_path / "checkpoints" / "step-000001", saved)


def test_a_group_relative_run_made_before_advantage_eps_was_the_methods_own(tmp_path):
    """``algo.advantage_eps`` was 1e-4 for every scale; null now means the method's own, filled in when the config is
    built. A GRPO checkpoint of before (1e-4, the group std's eps now too) resumes; a MaxRL one (scale_rewards=mean,
    1e-4 then, 1e-6 now: another update) is refused naming both values, as any changed setting."""
    from prefzoo.algos.grpo import GRPOConfig
    from prefzoo.training.resume import check_run_config, run_config

    def grpo(**algo):
        cfg = config(resume=True)
        cfg.algo = GRPOConfig(**algo)
        return cfg

    folder = tmp_path / "checkpoints" / "step-000001"
    check_run_config(grpo(), tmp_path, folder, run_config(grpo(advantage_eps=1e-4)))
    saved = run_config(grpo(scale_rewards="mean", advantage_eps=1e-4))
    with pytest.raises(ConfigError, match=r"algo\.advantage_eps: 0\.0001 \(checkpoint\) vs 1e-06 \(now\)"):
        check_run_config(grpo(scale_rewards="mean"), tmp_path, folder, saved)


# ------------------------------------------------------------------ item 7: the learning rate on resume
def test_a_changed_learning_rate_is_refused(run_dir):
    """Before the fix: trainer.lr=1e-3 was ignored (step 3 logged lr 0.0, the old schedule's) while config.yaml said
    1e-3. trainer.lr is run-defining."""
    with pytest.raises(ConfigError, match=r"trainer\.lr: 0\.005 \(checkpoint\) vs 0\.001 \(now\)"):
        loop.Trainer(with_changes(resumed(max_steps=4), trainer__lr=1e-3), run_dir).run()


def test_raising_max_steps_rebuilds_the_schedule_for_the_new_horizon(run_dir, caplog):
    """The run had 2 steps (one optimizer step each); resumed with max_steps=4 the linear schedule is the one of a
    4-step run, continued at optimizer step s=2: lr(s) = 5e-3 * (4 - s) / (4 - 1) for s >= warm-up 1, so step 3
    (s=2) logs 5e-3 * 2/3 and step 4 (s=3) 5e-3 * 1/3. Before the fix: step 3 logged lr 0.0 (the 2-step schedule's
    end) and step 4 5e-3 / 3."""
    with caplog.at_level(logging.WARNING):
        loop.Trainer(resumed(max_steps=4), run_dir).run()
    lrs = {r["step"]: r["lr"] for r in read_metrics(run_dir / "metrics.jsonl")}
    # float64 products of 3 numbers on both sides: ~3e-16 apart; rel 1e-12 leaves 3000x (kind 1 of tests/bounds.py)
    assert lrs[3] == pytest.approx(LR * 2 / 3, rel=1e-12)
    assert lrs[4] == pytest.approx(LR * 1 / 3, rel=1e-12)
    assert any("trainer.max_steps" in r.message and "schedule" in r.message for r in caplog.records)


# ------------------------------------------------------------------ item 8: a damaged newest checkpoint
@pytest.mark.parametrize("damage", ["truncated_state", "garbage_state", "truncated_adapter"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(run_dir, caplog, damage):
    """Before the fix (truncated_state): RuntimeError "PytorchStreamReader failed reading zip archive: failed finding
    central directory", naming no file. After: a warning naming step-000002, and the run continues from step 1."""
    newest = run_dir / "checkpoints" / "step-000002"
    target = newest / (STATE_FILE if damage.endswith("state") else "adapter/adapter_model.safetensors")
    data = target.read_bytes()
    target.write_bytes(b"not a checkpoint" if damage == "garbage_state" else data[:len(data) // 2])
    with caplog.at_level(logging.WARNING):
        summary = loop.Trainer(resumed(max_steps=3), run_dir).run()
    assert summary["steps"] == 3
    warning = [r.message for r in caplog.records if "damaged" in r.message]
    assert warning and str(newest) in warning[0] and "step-000001" in warning[0]
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    # set aside (not a checkpoint any more, so the newest two kept are the resumed run's)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["damaged-step-000002", "step-000002",
                                                                          "step-000003"]


def test_when_every_checkpoint_is_damaged_resume_is_refused_in_one_line(run_dir):
    for folder in complete_checkpoints(run_dir):
        (folder / STATE_FILE).write_bytes(b"")
    with pytest.raises(PrefzooError) as err:
        loop.Trainer(resumed(max_steps=3), run_dir).run()
    message = str(err.value)
    assert "\n" not in message and "step-000001" in message and "step-000002" in message


# ------------------------------------------------------------------ item 11: nothing to resume
def test_resume_with_nothing_to_resume_says_so(tmp_path, caplog):
    """Before the fix: no warning at all (the run silently started from step 0)."""
    with caplog.at_level(logging.WARNING):
        summary = loop.Trainer(resumed(max_steps=1), tmp_path).run()
    assert summary["steps"] == 1
    assert any("nothing to resume" in r.message and "from scratch" in r.message and str(tmp_path) in r.message
               for r in caplog.records)


# ------------------------------------------------------------------ item 16: no code runs from a checkpoint
class RunsCode:
    """Unpickling this calls os.mkdir(marker): what a malicious trainer_state.pt could do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_checkpoint_that_would_run_code_is_refused_and_the_code_does_not_run(run_dir, tmp_path, monkeypatch):
    """Before the fix: the resume created the marker folder (torch.load(weights_only=False) ran os.mkdir) and went
    on. After: one line naming the file and the refused global (posix.mkdir); the marker does not exist."""
    marker = tmp_path / "code-ran"
    state_file = run_dir / "checkpoints" / "step-000002" / STATE_FILE
    state = torch.load(state_file, weights_only=False)
    state["sampler"]["payload"] = RunsCode(marker)
    torch.save(state, state_file)
    monkeypatch.setattr(loop, "build_parts", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(PrefzooError) as err:
        loop.Trainer(resumed(max_steps=3), run_dir).run()
    message = str(err.value)
    assert "\n" not in message and str(state_file) in message and "mkdir" in message
    assert not marker.exists()


def test_the_trainer_state_loads_with_weights_only(prepared):
    """Tensors, plain numbers and strings only (numpy's RNG state as a list). Before the fix: UnpicklingError
    "Unsupported global: GLOBAL numpy.core.multiarray._reconstruct"."""
    state = torch.load(prepared / "checkpoints" / "step-000002" / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and isinstance(state["rng"]["numpy"], (list, tuple))


# ------------------------------------------------------------------ item 10: a full disk at a checkpoint
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_and_stops_cleanly(run_dir, monkeypatch):
    """Resume to step 3; the checkpoint write of step 3 fails with ENOSPC. Before the fix: the OSError itself,
    with a half-written step-000003 folder. After: a PrefzooError "no space left on <checkpoints>", the previous
    checkpoints intact and no partial folder, so a later resume continues from step 2."""
    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_trainer_state", full)
    with pytest.raises(PrefzooError, match=r"no space left on .*checkpoints"):
        loop.Trainer(resumed(max_steps=3), run_dir).run()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    monkeypatch.undo()
    summary = loop.Trainer(resumed(max_steps=3), run_dir).run()
    assert summary["steps"] == 3


def test_a_run_from_before_the_backend_group_resumes_and_the_backend_is_run_defining(tmp_path):
    """A checkpoint written before ``backend`` existed holds no backend.* key: it resumes as backend=local (the schema's
    default), and a backend=tinker run cannot resume it (its weights are a local adapter, not a server state); the
    server's address and timeout may change between a run and its resumption (issue 50)."""
    from prefzoo.config import Config
    from prefzoo.training.resume import check_run_config, run_config

    def cfg(**backend):
        from prefzoo.algos.grpo import GRPOConfig

        c = Config(algo=GRPOConfig(name="grpo"))
        for k, v in backend.items():
            setattr(c.backend, k, v)
        return c

    folder = tmp_path / "checkpoints" / "step-000001"
    old = {k: v for k, v in run_config(cfg()).items() if not k.startswith("backend.")}
    check_run_config(cfg(), tmp_path, folder, old)
    with pytest.raises(ConfigError, match="backend.name: '\\(absent\\)' \\(checkpoint\\) vs 'tinker' \\(now\\)"):
        check_run_config(cfg(name="tinker", url="http://127.0.0.1:9"), tmp_path, folder, old)
    remote = run_config(cfg(name="tinker", url="http://127.0.0.1:9"))
    check_run_config(cfg(name="tinker", url="http://10.0.0.2:8000", timeout=60.0), tmp_path, folder, remote)
