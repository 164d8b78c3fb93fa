"""prefzoo: PPO, GRPO, DPO and SimPO on one KL-regularised objective, J = E[r] - beta * D(pi || pi_ref).

See README.md for the two commands and usage, and DESIGN notes in the module docstrings:
``prefzoo.objective`` (the maths), ``prefzoo.algos`` (plugins), ``prefzoo.training`` (the shared loop).
"""

import logging as _logging
import warnings as _warnings

__version__ = "0.1.0"

# Third-party noise users cannot act on: bitsandbytes' optional CPU kernel package, a peft/transformers
# deprecation inside library code.
_logging.getLogger("bitsandbytes").setLevel(_logging.ERROR)
_warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
