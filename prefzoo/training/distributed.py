"""Data-parallel training on Hugging Face accelerate: which process this is, collectives, the DDP wrapper.

prefzoo has no distributed runtime of its own. ``accelerate launch`` or ``torchrun`` start the processes;
accelerate's :class:`~accelerate.Accelerator` sets up the process group (gloo on CPU, NCCL on GPUs), the
rank, the world size and the device; the trainable modules are wrapped in DDP by ``accelerator.prepare``.
This module is the thin layer the training loop talks to:

* :func:`check_launch` reads how the run was launched (accelerate's environment variables) and raises a
  :class:`~prefzoo.errors.ConfigError` for a combination prefzoo cannot run, before any model loads.
* :func:`setup_data_parallel` returns a :class:`DataParallel`: a single-process stand-in (every collective
  is the identity, nothing is wrapped) unless the launcher started several processes.
* :class:`TrainableModules` puts the policy model and the value model (PPO, reward modelling) under one
  DDP wrapper, so every gradient-carrying forward pass goes through DDP and all trainable parameters
  (adapters, value head) are all-reduced in the backward.

What is and is not supported (docs/scaling-out.md): DDP (``accelerate/ddp.yaml``,
``accelerate/cpu_ddp_2proc.yaml``, or ``torchrun``), for every algorithm, on GPUs (NCCL) and CPUs (gloo); FSDP2
(``accelerate/fsdp2.yaml`` or ``torchrun ... trainer.fsdp=true``: :mod:`prefzoo.training.fsdp`, what it refuses in
:func:`check_fsdp`). DeepSpeed ZeRO is refused with a message: the loop steps its own optimizer, which a DeepSpeed
engine does not allow.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import warnings

import torch
from torch import nn

from prefzoo.errors import ConfigError

log = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes")

#: where to look for the number of processes a launcher started, before any process group exists
_WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def launched_world_size() -> int:
    """The number of processes the launcher (torchrun, accelerate launch, mpirun) started; 1 if none."""
    for var in _WORLD_SIZE_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def launched_rank() -> int:
    """This process's global rank as the launcher set it (0 when not launched in several processes)."""
    for var in _RANK_VARS:
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


def _uses_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available()) or _flag("ACCELERATE_USE_CPU")


def _deepspeed_stage() -> str:
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if stage is None and path and os.path.isfile(path):
        try:
            stage = str(json.loads(open(path).read()).get("zero_optimization", {}).get("stage"))
        except (OSError, ValueError):
            stage = None
    return stage or "?"


def fsdp_requested(cfg) -> bool:
    """Whether the run shards with FSDP2: ``trainer.fsdp=true`` (torchrun), or an accelerate config with
    ``distributed_type: FSDP`` (``ACCELERATE_USE_FSDP``)."""
    return bool(cfg.trainer.fsdp) or _flag("ACCELERATE_USE_FSDP")


#: accelerate FSDP options prefzoo does not run, and what to do instead
_FSDP_REFUSED = {"FSDP_OFFLOAD_PARAMS": "fsdp_offload_params: false (parameters offloaded to the CPU are not supported)",
                 "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing: false, and model.gradient_checkpointing=true "
                                                  "for the same memory saving"}


def check_fsdp(cfg) -> None:
    """Refuse, before any model loads, what FSDP2 training does not run (prefzoo.training.fsdp).

    Raises:
        ConfigError: FSDP version 1; parameter offload or FSDP's activation checkpointing in the accelerate config;
            4-bit weights; and the rollout paths that need a whole model of their own: the merged-weights sampler's
            log-probs (``rollout.log_mismatch``, ``rollout.dtype``), ``rollout.engine=vllm``, asynchronous rollouts.
    """
    version = os.environ.get("FSDP_VERSION", "2") if _flag("ACCELERATE_USE_FSDP") else "2"
    where = "the accelerate config" if _flag("ACCELERATE_USE_FSDP") else "trainer.fsdp=true"
    if version != "2":
        raise ConfigError(f"{where} asks for FSDP version {version}; prefzoo shards with FSDP2 (torch's fully_shard): "
                          "set fsdp_version: 2 (accelerate/fsdp2.yaml).")
    for var, fix in _FSDP_REFUSED.items():
        if _flag(var):
            raise ConfigError(f"the accelerate config sets {var.lower()}: true, which prefzoo's FSDP2 training does "
                              f"not run; set {fix}.")
    m, r = cfg.model, cfg.rollout
    if m.quantization == "4bit":
        raise ConfigError(f"{where} shards the parameters, and 4-bit (bitsandbytes) weights are not sharded by "
                          "fully_shard here: set model.quantization=none, or train QLoRA under DDP "
                          "(accelerate/ddp.yaml, which replicates the quantised model).")
    if r.engine == "vllm_server":
        raise ConfigError(f"rollout.engine=vllm_server with {where}: the adapter the servers load is saved from a whole "
                          "model, not yet from FSDP's shards; train LoRA under DDP (accelerate/ddp.yaml: the adapter is "
                          "small and replicated), or use rollout.engine=hf.")
    refused = [("rollout.engine=vllm", r.engine == "vllm"),
               ("rollout.asynchronous=true", r.asynchronous),
               (f"rollout.dtype={r.dtype}", r.dtype is not None),
               ("rollout.log_mismatch=true", r.log_mismatch)]  # (algo.dynamic_sampling: refused with any data
    # parallelism, prefzoo.cli.preflight)
    for setting, on in refused:
        if on:
            raise ConfigError(f"{setting} needs a whole model beside the trainer (a merged copy, an engine or a "
                              f"worker), which {where} does not keep: the rollouts sample from the gathered shards. "
                              f"Drop {setting.split('=')[0]}, or train under DDP (accelerate/ddp.yaml).")


def check_launch(cfg) -> None:
    """Refuse, before any model loads, a launch configuration prefzoo cannot run.

    Reads accelerate's environment variables (``ACCELERATE_USE_FSDP``, ``ACCELERATE_USE_DEEPSPEED``,
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_DYNAMO_BACKEND``, ...),
    set by ``accelerate launch --config_file ...``, and the launcher's ``WORLD_SIZE``.

    Raises:
        ConfigError: DeepSpeed (with the most specific reason first: on CPU, not installed, parameter sharding of
            4-bit weights, then "not supported by prefzoo's loop"); what FSDP2 does not run (:func:`check_fsdp`);
            Megatron-LM; accelerate mixed precision or torch.compile (use ``model.dtype``); fewer items per
            step (``trainer.batch_size``) than processes.
    """
    t, m = cfg.trainer, cfg.model
    cpu = _uses_cpu(t.device)
    four_bit = m.quantization == "4bit"
    use_ddp = "use accelerate/ddp.yaml (or torchrun) instead: DDP replicates the model and works with every algorithm"
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        stage = _deepspeed_stage()
        if cpu:
            raise ConfigError(f"the accelerate config asks for DeepSpeed (ZeRO-{stage}), which needs GPUs, but this run "
                              f"is on the CPU (trainer.device={t.device}); for CPU processes use "
                              "accelerate/cpu_ddp_2proc.yaml.")
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"the accelerate config asks for DeepSpeed (ZeRO-{stage}) but the deepspeed package is "
                              f"not installed (pip install deepspeed); or {use_ddp}.")
        if stage == "3" and four_bit:
            raise ConfigError("DeepSpeed ZeRO-3 shards the model's parameters, which 4-bit (bitsandbytes) weights do "
                              f"not support: set model.quantization=none, or {use_ddp} (QLoRA runs under DDP).")
        raise ConfigError(f"DeepSpeed (ZeRO-{stage}) is not supported by prefzoo's training loop yet: it samples "
                          "rollouts, computes reference log-probs and evaluates with the plain model and steps its "
                          f"own optimizer, which a DeepSpeed engine does not allow; {use_ddp}.")
    if fsdp_requested(cfg):
        check_fsdp(cfg)
    if _flag("ACCELERATE_USE_MEGATRON_LM"):
        raise ConfigError(f"Megatron-LM is not supported by prefzoo; {use_ddp}.")
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if precision not in ("no", ""):
        raise ConfigError(f"the accelerate config sets mixed_precision={precision}; prefzoo chooses precision with "
                          f"model.dtype (e.g. model.dtype=bfloat16): set mixed_precision: 'no' in the accelerate config "
                          "(sampling and training must use the same numerics).")
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if dynamo not in ("no", ""):
        raise ConfigError(f"the accelerate config sets dynamo_backend={dynamo}; prefzoo does not compile the model: set "
                          "dynamo_backend: 'no'.")
    world = launched_world_size()
    if world > t.batch_size:
        raise ConfigError(f"trainer.batch_size={t.batch_size} is the GLOBAL batch of a step (prompts or pairs), "
                          f"shared by {world} processes, and each process needs at least one: raise "
                          f"trainer.batch_size to at least {world} (a multiple of {world} balances the work).")


class DataParallel:
    """This process's place among the data-parallel processes, and the collectives the loop needs.

    With ``accelerator=None`` it stands for a single process: rank 0 of 1, every collective the identity.
    """

    def __init__(self, accelerator=None, device: torch.device | None = None, fsdp: bool = False,
                 reshard_after_forward: bool = True):
        self.accelerator = accelerator
        self.fsdp = fsdp and accelerator is not None  # FSDP2 sharding (prefzoo.training.fsdp) instead of DDP
        self.reshard_after_forward = reshard_after_forward
        self.sharded: list[nn.Module] = []  # the roots sharded by wrap (FSDP)
        if accelerator is None:
            self.world_size, self.rank, self.local_rank = 1, 0, 0
            self.device = device
        else:
            self.world_size, self.rank = accelerator.num_processes, accelerator.process_index
            self.local_rank = accelerator.local_process_index
            d = accelerator.device
            self.device = torch.device("cpu") if d.type == "cpu" else d

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------- collectives
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over all processes (a new tensor on ``tensor``'s device)."""
        if not self.enabled:
            return tensor
        from accelerate.utils import reduce

        return reduce(tensor.to(self.device), reduction="sum").to(tensor.device)

    def gather_objects(self, obj) -> list:
        """``[obj of process 0, obj of process 1, ...]`` on every process (picklable objects)."""
        if not self.enabled:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])

    def broadcast_object(self, obj):
        """Process 0's ``obj``, on every process."""
        if not self.enabled:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=0)[0]

    def barrier(self) -> None:
        if self.enabled:
            self.accelerator.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first (e.g. to build and cache a data set), then the others."""
        if not self.enabled:
            yield
            return
        with self.accelerator.main_process_first():
            yield

    # -------------------------------------------------------------- the model
    def wrap(self, module: nn.Module, frozen: list[nn.Module] = ()) -> nn.Module:
        """``module`` (a :class:`TrainableModules`) prepared for data-parallel training; itself in one process.

        DDP: wrapped by ``accelerator.prepare_model`` (the module must already be on this process's device). FSDP:
        sharded in place (:func:`prefzoo.training.fsdp.shard`: the policy, the value model, and each module of
        ``frozen``, a reference copy) and returned unwrapped; its parameters are new (DTensor shards), so build the
        optimizer afterwards."""
        if not self.enabled:
            return module
        if self.fsdp:
            from prefzoo.training.fsdp import shard

            self.sharded = [m for m in (module.policy, getattr(module, "value", None), *frozen) if m is not None]
            shard(self.sharded, self.reshard_after_forward)
            return module
        with warnings.catch_warnings():  # torch >= 2.13 renames broadcast_buffers; accelerate still passes the old name
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            return self.accelerator.prepare_model(module, device_placement=False)

    def gathered(self):
        """FSDP: a context in which every sharded module is whole (:func:`prefzoo.training.fsdp.gathered`; every
        process enters it); otherwise nothing."""
        if not self.fsdp:
            return contextlib.nullcontext()
        from prefzoo.training.fsdp import gathered

        return gathered(self.sharded, self.reshard_after_forward)

    def full_state(self, module: nn.Module) -> dict | None:
        """FSDP: ``module``'s whole state dict on the main process ({} elsewhere; every process calls it); None
        otherwise (the module's own ``state_dict()`` is whole)."""
        if not self.fsdp:
            return None
        from prefzoo.training.fsdp import full_model_state

        return full_model_state(module)

    def max_over_processes(self, value: int) -> int:
        """The largest ``value`` over all processes (every process calls it)."""
        if not self.enabled:
            return value
        import torch.distributed as dist

        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def no_sync(self, wrapped: nn.Module):
        """Context in which backward passes accumulate gradients locally without all-reducing them."""
        return self.accelerator.no_sync(wrapped) if self.enabled else contextlib.nullcontext()

    def close(self) -> None:
        """Tear the process group down (end of the run). The caller drops its own references to the wrapped modules
        first; the accelerator's are released here, so that DDP's reducer, which holds the process group, is freed
        while the group is still up. Freed after ``destroy_process_group`` instead, the reducer's release runs the
        gloo group's destructor, which now and then waited forever on its worker threads once the other process had
        exited (seen in about 1 of 7 two-process GRPO runs on a loaded 2-core machine: a run that never exits)."""
        if self.enabled:
            import gc

            from accelerate.state import AcceleratorState, PartialState

            self.accelerator.free_memory()
            gc.collect()
            self.barrier()
            PartialState().destroy_process_group()
            AcceleratorState._reset_state(reset_partial_state=True)


#: the environment variable holding a data-parallel launch's shared random id (:func:`setup_data_parallel`)
LAUNCH_ID_ENV = "PREFZOO_LAUNCH_ID"


def setup_data_parallel(cfg, device: torch.device | None = None) -> DataParallel:
    """Check the launch (:func:`check_launch`) and, when the launcher started several processes, create
    accelerate's :class:`~accelerate.Accelerator` (process group, rank, device); else a single-process
    :class:`DataParallel` on ``device``.

    Under SLURM through hydra-submitit-launcher (``tasks_per_node`` > 1), the torch.distributed variables
    are first set from SLURM's with submitit's helper.
    """
    _export_submitit_environment()
    check_launch(cfg)
    if launched_world_size() <= 1:
        if fsdp_requested(cfg):
            log.warning("FSDP asked for, but the launcher started one process: nothing to shard over, the run trains "
                        "unsharded (start several with torchrun --nproc_per_node N or accelerate launch).")
        if "ACCELERATE_DYNAMO_BACKEND" in os.environ and "MASTER_ADDR" in os.environ:  # accelerate's simple launcher
            log.warning("accelerate launch started ONE process although several were asked for: accelerate starts "
                        "several local processes only for its multi-GPU type (also on a CPU-only machine). Use "
                        "--multi_gpu --num_processes N, or --config_file accelerate/cpu_ddp_2proc.yaml.")
        return DataParallel(None, device)
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # broadcast_buffers=False: the model's buffers (rotary tables) are the same everywhere (and synced when DDP
    # wraps the model); broadcasting them before every forward would add a collective per forward pass, and
    # processes with uneven shards run different numbers of forward passes
    fsdp = fsdp_requested(cfg)
    # under FSDP accelerate only starts the process group: prefzoo shards the modules itself (fully_shard), the
    # same way under torchrun and accelerate launch, so accelerate's own FSDP plugin is kept out
    hidden = os.environ.pop("ACCELERATE_USE_FSDP", None) if fsdp else None
    try:
        accelerator = Accelerator(cpu=_uses_cpu(cfg.trainer.device), mixed_precision="no",
                                  kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    finally:
        if hidden is not None:
            os.environ["ACCELERATE_USE_FSDP"] = hidden
    dp = DataParallel(accelerator, fsdp=fsdp, reshard_after_forward=os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true")
                      .lower() in _TRUE)
    log.info("data parallel: process %d of %d on %s (%s)", dp.rank, dp.world_size, dp.device,
             "FSDP2" if fsdp else accelerator.distributed_type)
    # one random id for this launch, process 0's on every process: what needs a name all processes agree on without
    # a collective of its own (rollout.engine=vllm_server's adapter names, built inside main_process_first blocks)
    import secrets

    os.environ[LAUNCH_ID_ENV] = dp.broadcast_object(secrets.token_hex(4))
    return dp


def _export_submitit_environment() -> None:
    """Under a submitit SLURM job of several tasks, set RANK/WORLD_SIZE/MASTER_ADDR/... from SLURM's variables."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or int(os.environ.get("SLURM_NTASKS", "1")) <= 1 \
            or os.environ.get("RANK"):
        return
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


class TrainableModules(nn.Module):
    """The modules whose parameters train, as ONE module for DDP.

    ``forward("policy", **kwargs)`` runs the causal LM, ``forward("value", batch)`` the value model (PPO's
    value function, algo=rm's reward model). Parameters the two share (a value adapter living inside the
    peft model) are registered once. Going through one DDP wrapper for both makes every trainable parameter
    part of the gradient all-reduce, whichever of the two forward passes it took part in.
    """

    def __init__(self, policy: nn.Module, value: nn.Module | None = None):
        super().__init__()
        self.policy = policy
        if value is not None:
            self.value = value

    def forward(self, route: str, *args, **kwargs):
        return getattr(self, route)(*args, **kwargs)
