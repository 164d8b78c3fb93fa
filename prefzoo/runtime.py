"""What a computation's numbers depend on beyond its inputs and settings: the libraries, the device, and on a CPU the
instruction set torch's kernels use and torch's thread count.

Two runs with the same settings and seed give the same samples only in the same such environment: a matmul's sums
are split by thread and vectorised by instruction set, so they round differently, and a sampled token whose uniform
falls within that rounding of a cumulative-probability boundary flips, after which the completion diverges. Measured on
SmolLM2-135M-Instruct (2-core AMD EPYC machines, torch 2.13.0): the default built-in pairs from one seed are 118
training pairs with AVX2 kernels at 2 threads, 106 with AVX512 at 2 threads and 109 with AVX512 at 1 thread
(docs/data.md, "What the pairs depend on"). The built-in pairs record
it (``stats.json``, ``sampled_with``) and the reused evaluation before training keys on it
(:mod:`prefzoo.training.baseline`).
"""

from __future__ import annotations

import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["numerics_environment", "KV_CACHE_ARGUMENT"]

#: the KV cache's keyword argument and output field of a causal LM's forward: ``cache`` in transformers >= 5.2x,
#: ``past_key_values`` before (the decode loop, :mod:`prefzoo.rollout.generate`, and the policy's shared-prompt pass,
#: :mod:`prefzoo.models.body`, call the model incrementally with it)
KV_CACHE_ARGUMENT = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def numerics_environment(device: torch.device | str) -> dict:
    """``{"torch", "transformers", "device", "threads"[, "cpu_capability"]}``: the torch and transformers versions, the
    device type, torch's intra-op thread count and, on a CPU, the kernels' instruction set
    (``torch.backends.cpu.get_cpu_capability()``: ``AVX2``, ``AVX512``, ...)."""
    kind = torch.device(device).type
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": kind,
           "threads": torch.get_num_threads()}
    if kind == "cpu":
        env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return env
