"""Tiny runs that several test modules read (each is paid once per session; fixtures in tests/conftest.py).

* :data:`CLI_RUN`: ``python train.py RUN hydra.run.dir=...`` in a subprocess, run in the background
  (tests/background.py; tests/test_cli.py reads its files and console, tests/test_api.py compares it with the API
  run);
* :func:`api_run`: ``prefzoo.train(RUN, run_dir=...)`` in this process, with the Trainer it ran kept
  (tests/test_api.py; tests/training/test_model_card.py reads its card, then resumes a copy of it).

Nothing writes into these folders: a test that changes a run works on a copy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests import background

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = "tests/fixtures/arithmetic_pairs.jsonl"
#: the command line's tiny DPO run: 2 steps on the bundled pairs, a checkpoint after each, 2 evaluations
TINY_RUN = ["algo=dpo", "model=tiny", "data=file", f"data.path={FIXTURE}", "trainer.max_steps=2",
            "trainer.batch_size=2", "trainer.save_every=1", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.num_threads=1", "trainer.device=cpu", "model.lora.r=4", "data.max_length=96",
            "data.max_prompt_length=64"]
#: the same with a learning rate large enough that the adapter moves the log-probs well beyond float rounding (so
#: "the adapter is loaded" is visible in them), and a small evaluation (2 x 2 diversity samples of 6 tokens: its
#: readers check which numbers there are and that files and card agree, not how many samples made them)
RUN = [*TINY_RUN, "trainer.lr=0.05", "eval.max_new_tokens=6", "eval.diversity_prompts=2", "eval.diversity_samples=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HYDRA_FULL_ERROR": "0"}


def _cli_run(base: Path) -> background.Command:
    return background.Command([sys.executable, "train.py", *RUN, f"hydra.run.dir={base / 'run'}"], ROOT, ENV)


#: ``python train.py RUN hydra.run.dir=<its folder>/run`` in the background (tests/background.py), read by
#: tests/test_api.py and tests/test_cli.py; ``.result().base / "run"`` is its run folder
CLI_RUN = background.register("tiny_cli_run", ("tests.test_api", "tests.test_cli"), _cli_run)


def api_run(base: Path):
    """prefzoo.train(RUN) in ``base/run`` on one torch thread, with the Trainer it ran kept (its policy at the end
    of training): (result, trainer, run folder)."""
    import pytest

    import prefzoo
    from prefzoo.training import loop
    from tests.models.helpers import threads

    kept = []
    real_run = loop.Trainer.run

    def run_and_keep(self):
        kept.append(self)
        return real_run(self)

    run_dir = base / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop.Trainer, "run", run_and_keep)
        with threads(1):
            result = prefzoo.train(RUN, run_dir=run_dir)
    return result, kept[0], run_dir
