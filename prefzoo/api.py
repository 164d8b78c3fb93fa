"""prefzoo's Python API: :func:`train` (what ``prefzoo train <overrides>`` does) and :func:`load_policy` (a trained run's
policy as a ``transformers`` model with its peft adapter, ready for ``generate``). See docs/python-api.md.

    import prefzoo

    result = prefzoo.train(["algo=dpo", "model=tiny", "trainer.max_steps=2"], run_dir="runs/first")
    model, tokenizer = prefzoo.load_policy(result.run_dir)

These two functions and :class:`RunResult` are the stable surface; everything else in prefzoo may move. ``import
prefzoo`` stays light: ``prefzoo/__init__.py`` imports this module only when one of its names is first used.

The same as the command line, step for step:

* the config is composed by Hydra's compose API from prefzoo's packaged ``prefzoo/conf`` (the same defaults list,
  config groups, plugin schemas and entry-point plugins), then checked as the command line checks it (renamed keys,
  values, the plugin's settings, the trackers, the data file), before any model loads;
* the run folder is the command line's: ``run_dir=`` if given, else the override ``hydra.run.dir=...``, else Hydra's
  default ``outputs/<date>/<time>-<algo>`` under the current folder; it holds the same files (``config.yaml``,
  ``metrics.jsonl``, ``summary.json``, ``eval_*.json``, ``adapter/`` with its model card, ``train.log``,
  ``.hydra/{config,hydra,overrides}.yaml``, checkpoints), and ``trainer.resume=true`` continues it;
* errors are the command line's :class:`~prefzoo.errors.PrefzooError` messages, raised instead of printed (a bad
  override: Hydra's message on one line, as ``prefzoo pairs`` prints it).

What differs: no sweep (``-m``) and no Hydra flags (call :func:`train` in a loop); prefzoo's log records go to the
run's ``train.log`` (and wherever your own logging config sends them), the console shows only prefzoo's prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from pathlib import Path

from prefzoo.errors import ConfigError, PrefzooError, UserCodeError, describe_error, user_code_frame
from prefzoo.training.names import algo_name

__all__ = ["RunResult", "train", "load_policy"]

#: Hydra's default log line (``hydra/job_logging=default``), used for the run's ``train.log``
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What :func:`train` returns: where the run wrote its files and its final numbers.

    Attributes:
        run_dir: the run folder (``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``eval_*.json``,
            ``adapter/``...); pass it to :func:`load_policy`.
        summary: ``summary.json`` as written: the algorithm, the resolved objective, the evaluations before and
            after training (``eval_before`` / ``eval_after``), the eval history, the last training step's scalars
            (``final_train_metrics``), timings.
        metrics: the run's final comparable numbers, ``summary["results"]`` (the same keys for every algorithm,
            :data:`prefzoo.training.loop.RESULT_KEYS`): held-out ``reward`` / ``task_accuracy`` (with ``_se``),
            ``kl``, ``entropy``, ``steps``, ``stop_reason``... None where the run has no such number.
    """

    run_dir: Path
    summary: dict
    metrics: dict


def one_line(err: BaseException) -> str:
    """An error's message on one line (Hydra's composition errors span several): its non-empty lines joined by
    ``"; "`` -- what ``prefzoo pairs`` prints after ``prefzoo: error:``."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _check_overrides(overrides) -> list[str]:
    from prefzoo.cli import check_renamed_keys

    if isinstance(overrides, str):
        raise ConfigError(f"prefzoo.train takes a list of overrides, got the string {overrides!r}; write "
                          f"prefzoo.train({overrides.split()!r}).")
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        what = (f"a {type(overrides).__name__} ({overrides!r:.60})" if not isinstance(overrides, (list, tuple)) else
                f"a list holding a {type(next(o for o in overrides if not isinstance(o, str))).__name__}")
        raise ConfigError(f"prefzoo.train takes a list of override strings (the command line's words, e.g. "
                          f"['algo=dpo', 'model=tiny']) or a prefzoo.config.Config; got {what}.")
    overrides = list(overrides)
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise ConfigError(f"prefzoo.train takes config overrides only, not command-line flags ({', '.join(flags)}); "
                          "for a sweep call prefzoo.train once per setting, or use `prefzoo train -m ...`.")
    check_renamed_keys(overrides)  # old key names fail naming the new one, as on the command line
    return overrides


def compose(overrides: list[str]):
    """(task config, hydra node) of ``prefzoo train <overrides>``: Hydra's compose API over prefzoo's packaged
    ``conf/``, plugins registered as the command line registers them.

    Raises:
        ConfigError: a bad override or config name (Hydra's message on one line).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from prefzoo.cli import register_configs
    from prefzoo.commands import conf_dir

    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    register_configs()
    backup = get_gh_backup()  # called from inside a Hydra app (its @hydra.main, a compose session): set aside
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = hydra_compose("config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(one_line(err)) from None
    finally:
        restore_gh_from_backup(backup)
    hydra_node = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, hydra_node


def default_run_dir(algo_name: str) -> Path:
    """Hydra's default run folder of ``conf/config.yaml`` (``outputs/%Y-%m-%d/%H-%M-%S-<algo>``), for a config given
    as a :class:`~prefzoo.config.Config`."""
    now = datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S')}-{algo_name}"


def _write_hydra_files(out: Path, task_cfg, hydra_node, overrides: list[str]) -> None:
    """``<run>/.hydra/{config,hydra,overrides}.yaml`` as Hydra writes them for a command-line run (the composed task
    config before resolution, Hydra's own node, the overrides)."""
    from omegaconf import OmegaConf, open_dict

    from prefzoo.training.run_folder import write_hydra_files

    subdir = hydra_node.get("output_subdir") if hydra_node is not None else ".hydra"
    if subdir is None:
        return
    hydra_cfg = None
    if hydra_node is not None:
        node = hydra_node.copy()
        with open_dict(node):  # what Hydra fills in for a run
            node.run.dir = str(out)
            node.mode = "RUN"
            node.runtime.output_dir = str(out.resolve())
            node.runtime.cwd = str(Path.cwd())
        hydra_cfg = OmegaConf.create({"hydra": node})
        overrides = list(hydra_node.overrides.task)  # the task's (hydra.* ones are in hydra.yaml), as Hydra writes
    write_hydra_files(out / str(subdir), task_cfg, hydra_cfg, overrides)


@contextlib.contextmanager
def _run_log(path: Path, enabled: bool):
    """prefzoo's log records (INFO and up) into ``path`` for the duration, as Hydra's ``train.log``; the caller's own
    logging configuration is left as it is."""
    if not enabled:
        yield
        return
    logger = logging.getLogger("prefzoo")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.INFO)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def train(overrides, run_dir: str | Path | None = None) -> RunResult:
    """Train as ``prefzoo train <overrides>`` (= ``python train.py <overrides>``) does, and return the run's result.

    Args:
        overrides: Hydra overrides, the command line's words (``["algo=dpo", "model=tiny", "trainer.max_steps=2"]``),
            or a :class:`prefzoo.config.Config` built in Python (its ``algo`` a plugin's config dataclass).
        run_dir: the run folder; default: the override ``hydra.run.dir=...`` if given, else Hydra's
            ``outputs/<date>/<time>-<algo>`` under the current folder. With ``trainer.resume=true`` an existing
            run folder is continued.

    Returns:
        :class:`RunResult` (the run folder, ``summary.json``, the final numbers).

    Raises:
        PrefzooError: the command line's one-line errors, raised instead of printed: a bad override (Hydra's
            message on one line), a bad value or combination (:class:`~prefzoo.errors.ConfigError`), a bad data
            file, a run folder in use or not writable, a model that cannot be loaded.
    """
    from omegaconf import OmegaConf

    from prefzoo.config import Config

    task_cfg, hydra_node, words = None, None, []
    if isinstance(overrides, Config):
        composed = OmegaConf.structured(overrides)
    else:
        words = _check_overrides(overrides)
        task_cfg, hydra_node = compose(words)
        composed = task_cfg
    from prefzoo.cli import check_data, preflight

    checked = preflight(composed, words)  # values, the plugin's settings, trackers: before any model loads
    typed = checked.config
    check_data(typed, checked.algo.declaration)  # a bad data file fails here, in seconds
    if run_dir is None:
        run_dir = Path(hydra_node.run.dir) if hydra_node is not None else default_run_dir(algo_name(typed.algo))
    summary, out = _train_in(checked, Path(run_dir), task_cfg, hydra_node, words)
    return RunResult(run_dir=out, summary=summary, metrics=dict(summary.get("results") or {}))


def _train_in(checked, out: Path, task_cfg, hydra_node, words: list[str]) -> tuple[dict, Path]:
    """The command line's run (:func:`prefzoo.cli.run_from_hydra`) in ``out``: data parallel set-up, the run folder
    checked and locked, ``.hydra/`` and ``config.yaml`` written, the Trainer run on the pre-flight's plugin
    (``checked``: :class:`prefzoo.cli.Preflight`)."""
    typed = checked.config
    from omegaconf import OmegaConf

    from prefzoo.training.distributed import setup_data_parallel
    from prefzoo.training.loop import Trainer, write_resolved_config
    from prefzoo.training.run_folder import open_run_folder
    from prefzoo.training.setup import pick_device, resolve_precision

    dp = setup_data_parallel(typed, pick_device(typed.trainer.device))
    try:
        out = Path(dp.broadcast_object(str(out)))
        resolve_precision(typed, dp.device or pick_device(typed.trainer.device))  # model.dtype=auto, before config.yaml
        folder = open_run_folder(typed, out, dp)  # writable, not in use, resumable with this config
        if dp.is_main:
            _write_hydra_files(out, task_cfg if task_cfg is not None else OmegaConf.structured(typed), hydra_node, words)
            write_resolved_config(typed, out)
        with _run_log(out / f"{hydra_node.job.name if hydra_node is not None else 'train'}.log", dp.is_main):
            summary = Trainer(typed, out, dp, folder=folder, algo=checked.algo).run()
    except (PrefzooError, KeyboardInterrupt):
        raise
    except BaseException as err:  # noqa: BLE001 -- SystemExit (and kin) from the user's code: a UserCodeError
        where = user_code_frame(err)
        if isinstance(err, Exception) or where is None:
            raise
        raise UserCodeError(f"your code raised {describe_error(err)} at {where}") from err
    finally:
        dp.close()
    return summary, out


# ---------------------------------------------------------------------------------------------------- load_policy
def load_policy(run_dir: str | Path, device: str = "cpu"):
    """A run's trained policy: ``(model, tokenizer)``, the model a ``transformers`` causal LM with the run's LoRA
    adapter loaded by ``peft`` (a ``PeftModel``), in eval mode with every parameter frozen, on ``device``.

    The base model is rebuilt from the run's saved ``config.yaml`` (``model.*``, ``trainer.seed``) as the run built
    it: SmolLM2 (``model=smollm2``), a Hugging Face id or folder, or ``model=tiny``'s random Llama from the same
    seed and shape, so the policy is the trained one exactly. A full fine-tuning run (``model.lora.enabled=false``)
    has its weights in ``model/`` instead, loaded as they are. Generate with ``model.generate(...)``; the tokenizer
    pads on the left and carries the chat template the run used.

    Raises:
        RunFolderError (a PrefzooError): the folder has no ``adapter/`` (or ``model/``) or no ``config.yaml`` (the
            message names the folder and what to pass instead).
        ModelError (a PrefzooError): its ``config.yaml`` cannot be read, or its base model cannot be loaded.
    """
    from prefzoo.training.trained import load_trained_model

    model, tokenizer, _ = load_trained_model(run_dir, device)
    return model, tokenizer
