"""prefzoo's entry point: ``python train.py algo=dpo|simpo|grpo|ppo|rm|bon [overrides]``.

Hydra composes ``conf/config.yaml`` over the typed defaults in :mod:`prefzoo.config`; the run writes its
resolved config, ``metrics.jsonl``, ``summary.json``, evaluations, checkpoints and the trained adapter
into its Hydra run folder (``hydra.run.dir=...`` to choose it). ``-m`` runs a sweep.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from prefzoo.cli import run_from_hydra
from prefzoo.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run_from_hydra(cfg)


if __name__ == "__main__":
    sys.exit(main())
