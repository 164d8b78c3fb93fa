"""``trainer.report_to`` (issue 14, item 5): evaluation numbers in TensorBoard beside the training scalars, trackio
and W&B through the libraries themselves (local / offline), and the up-front check of the tracker names.

The trackio and W&B tests need their packages (``pip install 'prefzoo[trackers]'``, an optional extra) and are
skipped without them.
"""

import json
import os

import pytest

from prefzoo.errors import ConfigError
from prefzoo.training import trackers
from prefzoo.training.loop import Trainer
from tests.algos.hydra_runs import TINY_RUN, compose
from tests.training.test_summary import PAIRS

RUN = [o for o in TINY_RUN if not o.startswith("trainer.tensorboard")]
DPO = ["algo=dpo", "trainer.max_steps=2", *PAIRS, *RUN]


def tensorboard_scalars(folder):
    """{tag: {step: value}} of the event files under ``folder`` (TensorBoard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.slow  # ~15 s: 2 DPO steps of the tiny model, 2 evaluations
def test_evaluations_are_in_tensorboard_beside_the_training_scalars(tmp_path):
    """Expected (read back with TensorBoard's EventAccumulator): the training loss at steps 1 and 2, and every
    number of eval_before.json at step 0 and of eval_after.json at step 2 as eval/<metric>, equal to the json
    (float32 in the event file: compared to 1e-6). Before: no eval/ tag at all (the first missing:
    eval/n_problems)."""
    run = tmp_path / "run"
    Trainer(compose(DPO), run).run()
    scalars = tensorboard_scalars(run / "tb")
    assert set(scalars["loss"]) == {1, 2}
    for tag, step in (("before", 0), ("after", 2)):
        result = json.loads((run / f"eval_{tag}.json").read_text())
        expected = {f"eval/{k}": v for k, v in result.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"}
        assert expected and "eval/n_problems" in expected
        for key, value in expected.items():
            assert scalars[key][step] == pytest.approx(value, rel=1e-6, abs=1e-6), key


@pytest.mark.parametrize("report_to,needle", [
    ("[tensorbord]", "trainer.report_to: unknown tracker 'tensorbord'; choose from ['tensorboard', 'trackio', "
                     "'wandb', 'none']"),
    ("[none,tensorboard]", "'none' turns every tracker off, so it stands alone"),
])
def test_bad_report_to_values_fail_before_the_model_loads(report_to, needle):
    with pytest.raises(ConfigError) as err:
        compose(DPO + [f"trainer.report_to={report_to}"])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_tracker_whose_package_is_missing_names_the_pip_command(monkeypatch):
    """find_spec says the package is absent (as in an environment without the extra)."""
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"wandb needs the package 'wandb', which is not installed; `pip install "
                                          r"wandb` \(or `pip install 'prefzoo\[trackers\]'`\)"):
        compose(DPO + ["trainer.report_to=[wandb]"])


def test_report_to_none_writes_no_tensorboard_folder(tmp_path):
    cfg = compose(DPO + ["trainer.report_to=[none]"])
    log = trackers.open_metrics_log(cfg, tmp_path, True)
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "tb").exists() and (tmp_path / "metrics.jsonl").is_file()


def wandb_records(path):
    """The records of a W&B offline run file (``run-*.wandb``): W&B's framing (a 7-byte header ':W&B', then
    LevelDB-style 32 KiB blocks of chunks: crc32, length, type FULL/FIRST/MIDDLE/LAST), each a
    ``wandb_internal_pb2.Record`` parsed with W&B's own protobuf classes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind == 2 else buf + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.mark.slow
def test_wandb_offline_run_holds_training_and_evaluation_scalars_and_the_config(tmp_path, monkeypatch):
    """W&B in offline mode (no network): its run file holds, by step, the training loss of metrics.jsonl at steps
    1 and 2, eval/n_problems of eval_before.json at step 0 and of eval_after.json at step 2, and the resolved
    config (algo.name dpo, trainer.max_steps 2). Read back from the file W&B wrote (wandb_records), not through
    prefzoo."""
    pytest.importorskip("wandb", reason="W&B is an optional extra: pip install 'prefzoo[trackers]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    Trainer(compose(DPO + ["trainer.report_to=[tensorboard,wandb]"]), run).run()
    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert {s: history[s]["loss"] for s in (1, 2)} == pytest.approx(losses)
    assert history[0]["eval/n_problems"] == json.loads((run / "eval_before.json").read_text())["n_problems"]
    assert history[2]["eval/n_problems"] == json.loads((run / "eval_after.json").read_text())["n_problems"]
    assert config["algo"]["name"] == "dpo" and config["trainer"]["max_steps"] == 2


@pytest.mark.slow
def test_trackio_local_run_holds_training_and_evaluation_scalars_and_the_config(tmp_path, monkeypatch):
    """trackio in local mode (its SQLite store, in a folder of the test's own: TRACKIO_DIR): the run's rows hold
    the training loss of metrics.jsonl at steps 1 and 2 and eval/n_problems of eval_after.json at step 2, and its
    config the resolved algo.name (dpo). Read back with trackio's own SQLiteStorage, not through prefzoo."""
    pytest.importorskip("trackio", reason="trackio is an optional extra: pip install 'prefzoo[trackers]'")
    import sys
    from pathlib import Path

    store = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    monkeypatch.setenv("TRACKIO_PROJECT", "prefzoo-test")
    import trackio.sqlite_storage as storage

    for mod in [m for name, m in sys.modules.items() if name.startswith("trackio") and hasattr(m, "TRACKIO_DIR")]:
        monkeypatch.setattr(mod, "TRACKIO_DIR", Path(store))  # read when trackio is first imported
    run = tmp_path / "run"
    Trainer(compose(DPO + ["trainer.report_to=[trackio]"]), run).run()
    rows = storage.SQLiteStorage.get_logs("prefzoo-test", run.name)
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update({k: v for k, v in row.items() if v is not None})
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert {s: by_step[s]["loss"] for s in (1, 2)} == pytest.approx(losses)
    assert by_step[2]["eval/n_problems"] == json.loads((run / "eval_after.json").read_text())["n_problems"]
    config = storage.SQLiteStorage.get_run_config("prefzoo-test", run.name)
    assert config["algo"]["name"] == "dpo"
    assert storage.SQLiteStorage.get_project_db_path("prefzoo-test").is_relative_to(store)
