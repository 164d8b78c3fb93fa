"""prefzoo: PPO, GRPO, DPO and SimPO on one KL-regularised objective, J = E[r] - beta * D(pi || pi_ref).

The Python API (docs/python-api.md), the stable surface:

* ``prefzoo.train(overrides, run_dir=None) -> RunResult``: what ``prefzoo train <overrides>`` does;
* ``prefzoo.load_policy(run_dir) -> (model, tokenizer)``: a run's trained policy (peft adapter loaded), for ``generate``;
* ``prefzoo.RunResult``: the run folder, ``summary.json``, the final numbers.

They live in :mod:`prefzoo.api` and are imported on first use (module ``__getattr__``): ``import prefzoo`` loads no
torch, transformers or Hydra. See README.md for the commands, and the module docstrings: ``prefzoo.objective`` (the
maths), ``prefzoo.algos`` (plugins), ``prefzoo.training`` (the shared loop).
"""

import logging as _logging
import warnings as _warnings

__version__ = "0.1.0"

#: the names of prefzoo.api that ``prefzoo.<name>`` gives (imported when first asked for)
_API = ("train", "load_policy", "RunResult")
__all__ = ["__version__", *_API]

# Third-party noise users cannot act on: bitsandbytes' optional CPU kernel package, a peft/transformers
# deprecation inside library code.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def __getattr__(name: str):
    if name in _API:
        from prefzoo import api

        return getattr(api, name)
    raise AttributeError(f"module 'prefzoo' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_API})
