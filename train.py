"""prefzoo's entry point: ``python train.py algo=dpo|simpo|grpo|ppo|rm|bon|custom [overrides]``.

Hydra composes ``conf/config.yaml`` over the typed defaults in :mod:`prefzoo.config`; the run writes its
resolved config, ``metrics.jsonl``, ``summary.json``, evaluations, checkpoints and the trained adapter
into its Hydra run folder (``hydra.run.dir=...`` to choose it). ``-m`` runs a sweep
(``hydra/launcher=submitit_local`` or ``submitit_slurm`` to run its jobs as subprocesses or SLURM jobs).
Data parallel: ``accelerate launch --config_file accelerate/ddp.yaml train.py ...`` or
``torchrun --nproc_per_node N train.py ...`` (README, "Scaling out").
"""

from __future__ import annotations

import sys
import warnings

import hydra
from omegaconf import DictConfig

from prefzoo.cli import register_configs, reject_renamed_keys, run_from_hydra, secondary_process_overrides
from prefzoo.training.run_folder import refuse_unusable_output_dir

register_configs()
# conf/hydra/launcher/submitit_*.yaml spell out hydra-submitit-launcher's fields (documented) under the plugin's own
# names, so Hydra validates them against the plugin's schema, with a deprecation notice this silences
warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_\w+' is validated against ConfigStore schema")


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return run_from_hydra(cfg)


if __name__ == "__main__":
    reject_renamed_keys(sys.argv[1:])  # old key names (algo.num_generations, ...) fail naming the new one
    sys.argv = secondary_process_overrides(sys.argv)  # torchrun / accelerate launch: only rank 0 writes
    refuse_unusable_output_dir(sys.argv)  # a file or read-only hydra.run.dir: one line, before Hydra's traceback
    sys.exit(main())
