"""The ``prefzoo`` command (console script) and ``python -m prefzoo``: one entry point for every command.

    prefzoo train [hydra overrides]       what ``python train.py`` does (``-m`` for a sweep, ``--cfg job``, ...)
    prefzoo pairs [overrides]             build (or find) the cached built-in preference pairs
    prefzoo report DIR [--out OUT]        report.md + plots of a run folder or a sweep folder
    prefzoo diagnose RUN_DIR [--json]     the beta doctor: not moving, drifting, verbose, repetitive, collapsing?
    prefzoo conformance [--seeds N ...]   the conformance table of every plugin (prefzoo.lab.conformance)
    prefzoo toy [--algo grpo ...]         the toy bandit's reward-vs-KL frontier (prefzoo.lab.toy)
    prefzoo serve --model M --port P      a vLLM server a run samples from (rollout.engine=vllm_server; prefzoo.serve)

The configs ship inside the package (``prefzoo/conf/``, :func:`conf_dir`), so an installed wheel runs
``prefzoo train algo=dpo model=tiny`` from any folder. A config folder of your own is added with Hydra's
``--config-dir DIR`` (searched before prefzoo's: ``prefzoo train --config-dir my_conf algo=my_algo``) or
``hydra.searchpath=[file:///abs/dir]``, without copying prefzoo's.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from prefzoo.report.sweep_dirs import register_resolver

PROG = "prefzoo"
register_resolver()  # hydra.sweep.subdir's ${prefzoo.job_dirname:}, also where a launcher runs jobs in other processes


def conf_dir() -> Path:
    """``prefzoo/conf``: the packaged config folder (``conf/`` at the repository root is a link to it)."""
    return Path(__file__).resolve().parent / "conf"


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")  # absolute: any cwd
def _hydra_train(cfg: DictConfig) -> float | None:
    from prefzoo.cli import run_from_hydra

    return run_from_hydra(cfg)


def train(argv: list[str]) -> int:
    """``prefzoo train [overrides]``: the command line ``python train.py`` takes (Hydra's flags included)."""
    from prefzoo.cli import register_configs, reject_renamed_keys, secondary_process_overrides
    from prefzoo.training.run_folder import refuse_unusable_output_dir

    register_configs()
    # conf/hydra/launcher/submitit_*.yaml spell out hydra-submitit-launcher's fields under the plugin's own names, so
    # Hydra validates them against the plugin's schema, with a deprecation notice this silences
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_\w+' is validated against ConfigStore schema")
    reject_renamed_keys(argv)  # old key names (algo.num_generations, ...) fail naming the new one
    full = secondary_process_overrides([f"{PROG} train", *argv])  # torchrun: only rank 0 writes
    full = defer_hydra_record(full)  # .hydra/ written once the run folder is accepted (prefzoo.training.run_folder)
    refuse_unusable_output_dir(full)  # a file or read-only hydra.run.dir: one line, before Hydra's traceback
    sys.argv = full  # Hydra reads its command line from sys.argv
    _hydra_train()
    return 0


def defer_hydra_record(argv: list[str]) -> list[str]:
    """``argv`` with ``hydra.output_subdir=null``: Hydra writes no ``.hydra/`` when the job starts, before the run
    folder is checked; the run writes it once the folder is accepted, where Hydra would have
    (:func:`prefzoo.training.run_folder.record_hydra_run`, told by the environment variable ``PREFZOO_HYDRA_SUBDIR``:
    ``.hydra``, the user's own ``hydra.output_subdir=<name>``, or empty after ``hydra.output_subdir=null``)."""
    import os

    from prefzoo.training.run_folder import HYDRA_SUBDIR_ENV

    subdir, kept = ".hydra", []
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "hydra.output_subdir":
            subdir = "" if value.strip().lower() in ("null", "~", "none", "") else value.strip().strip("'\"")
        else:
            kept.append(arg)
    os.environ[HYDRA_SUBDIR_ENV] = subdir
    # beside the user's overrides (Hydra's parser takes one run of positional overrides; flags may come after them)
    first = next((i for i, a in enumerate(kept) if i > 0 and "=" in a and not a.startswith("-")), len(kept))
    return [*kept[:first], "hydra.output_subdir=null", *kept[first:]]


def pairs(argv: list[str]) -> int:
    from prefzoo.cli import build_pairs

    return build_pairs(argv)


def report(argv: list[str]) -> int:
    from prefzoo.report import main as report_main

    return report_main(argv)


def diagnose(argv: list[str]) -> int:
    from prefzoo.report.diagnose import main as diagnose_main

    return diagnose_main(argv)


def conformance(argv: list[str]) -> int:
    from prefzoo.lab.conformance import main as conformance_main

    return conformance_main(argv)


def toy(argv: list[str]) -> int:
    from prefzoo.lab.toy import main as toy_main

    return toy_main(argv)


def serve(argv: list[str]) -> int:
    from prefzoo.serve import main as serve_main

    return serve_main(argv)


#: ``prefzoo COMMAND [arguments]``
COMMANDS = {"train": train, "pairs": pairs, "report": report, "diagnose": diagnose,
            "conformance": conformance, "toy": toy, "serve": serve}


def usage() -> str:
    return __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> int:
    """``prefzoo COMMAND [arguments]`` / ``python -m prefzoo COMMAND [arguments]``: run one command, return its status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(f"usage: {PROG} COMMAND [arguments]\n\n{usage()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"got {argv[0]!r}" if argv else "got none"
        print(f"{PROG}: error: {PROG} needs a command: {', '.join(COMMANDS)} ({got}); "
              f"e.g. `{PROG} train algo=dpo model=tiny` (`{PROG} --help` lists them)", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
