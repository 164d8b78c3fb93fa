"""What a run folder holds (docs/usage.md, "What a run writes"): every file and folder name, once.

The loop writes them, the checkpoint and resume code reads them back, and the readers outside the loop -- the report,
the beta doctor (``prefzoo diagnose``), ``prefzoo.load_policy`` -- take them from here too. Imports nothing.
"""

from __future__ import annotations

__all__ = ["CONFIG_FILE", "METRICS_FILE", "SUMMARY_FILE", "EVAL_FILE", "CHECKPOINTS_DIR", "ADAPTER_DIR", "MODEL_DIR",
           "STATE_FILE", "RUN_CONFIG_FILE", "LOCK_FILE"]

CONFIG_FILE = "config.yaml"  #: the resolved config of the run
METRICS_FILE = "metrics.jsonl"  #: one line per logged training step
SUMMARY_FILE = "summary.json"  #: the run's final numbers and its evaluations
EVAL_FILE = "eval_{tag}.json"  #: a held-out evaluation (tag: before, after, step<N>)
CHECKPOINTS_DIR = "checkpoints"  #: checkpoints/step-N/ (the resume points)
ADAPTER_DIR = "adapter"  #: the trained LoRA adapter, in the standard peft format (with its model card)
MODEL_DIR = "model"  #: the fully fine-tuned model, instead of adapter/ when LoRA is off
STATE_FILE = "trainer_state.pt"  #: in a checkpoint: optimizer, scheduler, RNG and loop state
RUN_CONFIG_FILE = "run_config.json"  #: in a checkpoint: the settings a resume must keep
LOCK_FILE = ".prefzoo.lock"  #: held by the run that uses the folder
