"""prefzoo's entry point: ``python train.py algo=dpo|simpo|grpo|ppo|rm|bon|custom [overrides]``.

A thin shim over ``prefzoo train`` (:func:`prefzoo.commands.train`, the same as ``python -m prefzoo train``).
Hydra composes ``prefzoo/conf/config.yaml`` (``conf/`` here is a link to it) over the typed defaults in
:mod:`prefzoo.config`; the run writes its resolved config, ``metrics.jsonl``, ``summary.json``, evaluations,
checkpoints and the trained adapter into its Hydra run folder (``hydra.run.dir=...`` to choose it). ``-m`` runs a
sweep (``hydra/launcher=submitit_local`` or ``submitit_slurm`` to run its jobs as subprocesses or SLURM jobs).
Data parallel: ``accelerate launch --config_file accelerate/ddp.yaml train.py ...`` or
``torchrun --nproc_per_node N train.py ...`` (README, "Scaling out").
"""

import sys

from prefzoo.commands import train

if __name__ == "__main__":
    sys.exit(train(sys.argv[1:]))
