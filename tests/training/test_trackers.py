"""``trainer.report_to`` (issue 14, item 5): evaluation numbers in TensorBoard beside the training scalars, trackio
and W&B through the libraries themselves (local / offline), and the up-front check of the tracker names.

The trackio and W&B tests need their packages: the ``trackers`` extra, which the ``test`` extra includes (``make test``
installs it), so they run in every test environment and FAIL (naming the pip command) rather than skip without them.
They run without a network: W&B in offline mode, trackio in local mode (its SQLite store in the test's folder), and
:func:`no_network` makes any connection to a non-local address raise in the test process.
"""

import json
import os
import socket

import pytest
import yaml

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


@pytest.mark.slow  # the module's one tracked run (tracked_run): 2 DPO steps of the tiny model, 2 evaluations
def test_evaluations_are_in_tensorboard_beside_the_training_scalars(tracked_run):
    """Expected (read back with TensorBoard's EventAccumulator): the training loss at steps 1 and 2, and every
    number of eval_before.json at step 0 and of eval_after.json at step 2 as eval/<metric>, equal to the json
    up to the one rounding of the event file's float32: |fl32(x) - x| <= u32 |x| (kind 1 of tests/bounds.py; the
    bound was rel = abs = 1e-6, 17 times that and loose near 0). Before: no eval/ tag at all (the first missing:
    eval/n_problems)."""
    from tests.bounds import U32

    run = tracked_run["run"]
    scalars = tensorboard_scalars(run / "tb")
    assert set(scalars["loss"]) == {1, 2}
    for tag, step in (("before", 0), ("after", 2)):
        result = json.loads((run / f"eval_{tag}.json").read_text())
        expected = {f"eval/{k}": v for k, v in result.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seconds"}
        assert expected and "eval/n_problems" in expected
        for key, value in expected.items():
            assert abs(scalars[key][step] - value) <= U32 * abs(value), key


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


def require(package: str):
    """Import an optional tracker package, or FAIL naming the install command (``make test`` installs them)."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        pytest.fail(f"{package} is not installed: `pip install -e '.[test]'` (its extra 'trackers' holds trackio and "
                    "wandb), or `make test`, which does")


LOCAL = ("127.0.0.1", "::1", "localhost", "", None)


def refuse_the_network(monkeypatch) -> list[str]:
    """Every name lookup and connection of this process to an address that is not local, recorded (and refused)
    while ``monkeypatch`` is in force: the tests assert the list is empty. (W&B's own service runs in a child
    process over a local socket; trackio writes SQLite.) Threads of the trackers are covered: a refused lookup in a
    background thread does not fail the test by itself, the record does."""
    attempts: list[str] = []
    real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in LOCAL:
            attempts.append(f"connect {address}")
            raise OSError("no network in this test")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOCAL:
            attempts.append(f"lookup {host}")
            raise socket.gaierror(f"no network in this test: {host}")
        return real_lookup(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def expected_scalars(run) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of what the run itself wrote: every finite number of metrics.jsonl at its step, and
    every number of eval_before.json (step 0) and eval_after.json (the last step) as eval/<key> (but the timing
    ``seconds``)."""
    out: dict[int, dict[str, float]] = {}
    for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step" and trackers.numeric({k: v})})
    last = max(out)
    for tag, step in (("before", 0), ("after", last)):
        result = json.loads((run / f"eval_{tag}.json").read_text())
        out.setdefault(step, {}).update({f"eval/{k}": v for k, v in trackers.numeric(result).items() if k != "seconds"})
    return out


def train(overrides: list[str], run) -> None:
    """The command line's run in ``run``: model.dtype=auto resolved and the config.yaml written first (prefzoo.cli),
    then the Trainer."""
    from prefzoo.training.loop import write_resolved_config
    from prefzoo.training.setup import pick_device, resolve_precision

    cfg = compose(overrides)
    run.mkdir(parents=True)
    resolve_precision(cfg, pick_device(cfg.trainer.device))
    write_resolved_config(cfg, run)
    Trainer(cfg, run).run()


def saved_config(run) -> dict:
    """The run's resolved config as config.yaml holds it."""
    return yaml.safe_load((run / "config.yaml").read_text())


def assert_holds(tracked: dict[int, dict], expected: dict[int, dict]) -> None:
    """Every value of ``expected`` (metrics.jsonl, eval_*.json) at its step in ``tracked`` (a tracker's own record).
    The values travel as JSON text or SQLite doubles, exact copies of the float64s (kind 1 of tests/bounds.py):
    rel 1e-9 / abs 1e-12 only forgive a tracker that reprints a number with fewer digits (15 digits: ~1e-15)."""
    assert set(expected) == {0, 1, 2} and len(expected[1]) > 5 and len(expected[0]) > 5  # loss, ..., eval/<...>
    for step, values in expected.items():
        got = {k: tracked.get(step, {}).get(k) for k in values}
        assert got == pytest.approx(values, rel=1e-9, abs=1e-12), step


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """The module's one run with every tracker on (trainer.report_to=[tensorboard,wandb,trackio]; the three tests
    below read it): W&B in offline mode (prefzoo's default when WANDB_MODE is unset), trackio in local mode (its
    SQLite store in a folder of its own: TRACKIO_DIR), and no name lookup or connection beyond the machine while it
    runs and while the tests read it (:func:`refuse_the_network`, the record in ``attempts``).
    {"run", "store", "attempts"}."""
    require("wandb")
    require("trackio")
    import sys
    from pathlib import Path

    base = tmp_path_factory.mktemp("tracked")
    store = base / "trackio"
    with pytest.MonkeyPatch.context() as monkeypatch:
        attempts = refuse_the_network(monkeypatch)
        monkeypatch.setenv("WANDB_MODE", "unset")  # (so that the variable prefzoo sets is undone after the module)
        monkeypatch.delenv("WANDB_MODE")  # prefzoo's default: offline
        monkeypatch.setenv("WANDB_SILENT", "true")
        monkeypatch.setenv("TRACKIO_DIR", str(store))
        monkeypatch.setenv("TRACKIO_PROJECT", "prefzoo-test")
        for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
            monkeypatch.delenv(name, raising=False)
        import trackio.sqlite_storage  # noqa: F401

        for mod in [m for name, m in sys.modules.items() if name.startswith("trackio") and hasattr(m, "TRACKIO_DIR")]:
            monkeypatch.setattr(mod, "TRACKIO_DIR", Path(store))  # read when trackio is first imported
        run = base / "run"
        train(DPO + ["trainer.report_to=[tensorboard,wandb,trackio]"], run)
        yield {"run": run, "store": store, "attempts": attempts}


@pytest.mark.slow
def test_wandb_offline_run_holds_training_and_evaluation_scalars_and_the_config(tracked_run):
    """W&B in offline mode (prefzoo's default when WANDB_MODE is unset; no network): its run file holds, at their
    steps, every training scalar of metrics.jsonl (steps 1 and 2), every number of eval_before.json at step 0 and of
    eval_after.json at step 2 as eval/<key>, and as its config the run's whole config.yaml. Read back from the file
    W&B wrote (wandb_records, W&B's protobuf classes), not through prefzoo; no name lookup or connection beyond the
    machine, and no telemetry exporter built. Before (trackers extra not installed): skipped; then, with W&B
    installed, W&B's telemetry thread looked up api.forge.coreweave.com (WANDB_MODE unset: only wandb.init got
    mode="offline")."""
    run = tracked_run["run"]
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
    assert_holds(history, expected_scalars(run))
    assert {k: v for k, v in config.items() if not k.startswith("_")} == saved_config(run)
    # no usage telemetry either: W&B built no telemetry exporter (its background thread posts to W&B's server)
    from wandb.analytics.opentelemetry import opentelemetry_proxy

    assert getattr(opentelemetry_proxy, "_singleton_telemetry_proxy", None) is None
    assert tracked_run["attempts"] == []


@pytest.mark.slow
def test_trackio_local_run_holds_training_and_evaluation_scalars_and_the_config(tracked_run):
    """trackio in local mode (its SQLite store, in a folder of the test's own: TRACKIO_DIR; no network): the run's
    rows hold, at their steps, every training scalar of metrics.jsonl, every number of eval_before.json at step 0
    and of eval_after.json at step 2 as eval/<key>, and its config the run's whole config.yaml. Read back with
    trackio's own SQLiteStorage, not through prefzoo; no name lookup or connection beyond the machine. Before
    (trackers extra not installed): skipped."""
    import trackio.sqlite_storage as storage

    run, store = tracked_run["run"], tracked_run["store"]
    rows = storage.SQLiteStorage.get_logs("prefzoo-test", run.name)
    by_step = {}
    for row in rows:
        by_step.setdefault(row["step"], {}).update({k: v for k, v in row.items() if v is not None})
    assert_holds(by_step, expected_scalars(run))
    config = storage.SQLiteStorage.get_run_config("prefzoo-test", run.name)
    assert {k: v for k, v in config.items() if not k.startswith("_")} == saved_config(run)
    assert storage.SQLiteStorage.get_project_db_path("prefzoo-test").is_relative_to(store)
    assert tracked_run["attempts"] == []


def test_offline_defaults_are_set_only_where_the_user_set_nothing():
    """W&B's mode: unset -> prefzoo sets WANDB_MODE=offline; set by the user (online, disabled) -> left as it is."""
    env: dict = {}
    assert trackers.offline_defaults("wandb", env) == {"WANDB_MODE": "offline"} and env == {"WANDB_MODE": "offline"}
    for mode in ("online", "disabled"):
        env = {"WANDB_MODE": mode}
        assert trackers.offline_defaults("wandb", env) == {} and env == {"WANDB_MODE": mode}
    assert trackers.offline_defaults("trackio", env) == {}


def test_the_test_environment_installs_the_trackers():
    """pyproject.toml's ``test`` extra (what ``make test`` installs: ``pip install -e '.[test,tinker]'``) holds every
    package of the ``trackers`` extra, so the trackio and W&B tests run instead of being skipped (and the ``tinker``
    extra comes with it: tests/tinker runs the SDK against the server)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["trackers"]) <= set(extras["test"])
    assert '-e ".[test,tinker]"' in (root / "Makefile").read_text()
