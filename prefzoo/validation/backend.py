"""The pre-flight of ``backend=tinker`` (:mod:`prefzoo.tinker.backend`): what a Tinker server cannot do is refused in
one line before anything loads, then the server is asked whether it answers and serves the run's model.

A Tinker server gives, per datum, the log-prob of each target token at temperature 1 (``forward``), gradients of a
per-token weighted sum of them (``forward_backward``), an Adam step (``optim_step``) on a LoRA adapter, samples with
their log-probs, and a base model's log-probs (a sampling client on the base weights). So it cannot give:

* log-probs at another temperature, per-token entropies, full-vocabulary losses (distillation's JSD): all need the
  whole next-token distribution;
* a value head (PPO's critic), a separate teacher, offline rows other than pairs (not built yet), full fine-tuning
  (the API trains LoRA adapters), 4-bit weights,
  vLLM engines, asynchronous rollouts, several processes (the server is the parallelism), multi-turn episodes (not
  built yet), the sampler correction (it reads the full support).
"""

from __future__ import annotations

from prefzoo.errors import ConfigError

__all__ = ["check_backend", "check_backend_server", "base_model_name"]


def base_model_name(cfg) -> str:
    """The server's name of the run's model: ``backend.base_model``, else ``model.name``."""
    return cfg.backend.base_model or cfg.model.name


def _refusals(cfg, declaration, processes: int):
    """(what, why) of each setting ``backend=tinker`` cannot run, in the order they are reported."""
    d, r, m = declaration, cfg.rollout, cfg.model
    algo = cfg.algo.preset or cfg.algo.name
    yield d.teacher is not None, (f"algo={algo} trains on the teacher's whole next-token distribution (a "
                                  "full-vocabulary loss); a Tinker server returns the target tokens' log-probs only")
    yield d.value_head is not None, (f"algo={algo} needs a value head (a critic beside the policy); a Tinker server "
                                     "trains one LoRA adapter and has none (use algo=grpo, rloo or reinforce_pp)")
    yield d.trains and not d.online and d.data != "pairs", (f"algo={algo} trains offline on {d.data}; backend=tinker "
                                                            "runs the online family and the pairwise losses (dpo, "
                                                            "simpo, orpo) for now")
    yield not d.trains, f"algo={algo} trains nothing; run it locally (backend=local)"
    yield r.temperature != 1.0, (f"rollout.temperature={r.temperature}: the loss needs log-probs at the sampling "
                                 "temperature and a Tinker server returns them at temperature 1 only; set "
                                 "rollout.temperature=1.0")
    yield d.token_entropy, (f"algo={algo}'s loss reads the per-token entropy (algo.top_entropy_quantile < 1), which "
                            "a Tinker server does not return; set algo.top_entropy_quantile=1.0")
    yield not m.lora.enabled, ("model.lora.enabled=false: a Tinker server trains LoRA adapters (rank model.lora.r) "
                               "only")
    lora = type(m.lora)()  # (the defaults: what the API's create_lora_training_client can ask for is the rank)
    yield m.lora.alpha != lora.alpha, (f"model.lora.alpha={m.lora.alpha}: the Tinker API sets the rank only "
                                       f"(model.lora.r); the server's scaling is its own (prefzoo's: {lora.alpha})")
    yield m.lora.target_modules != lora.target_modules or bool(m.lora.modules_to_save), (
        "model.lora.target_modules / modules_to_save: the Tinker API trains its attention and MLP layers' adapters "
        "(prefzoo's all-linear), nothing else")
    yield bool(m.adapter_path), (f"model.adapter_path={m.adapter_path}: the server starts from its own base model "
                                 "(a fresh adapter, or a resumed run's server state)")
    yield m.quantization != "none", f"model.quantization={m.quantization}: the server chooses its own weights' format"
    yield r.engine != "hf", (f"rollout.engine={r.engine}: with backend=tinker the server samples; set "
                             "rollout.engine=hf (the default)")
    yield r.asynchronous, "rollout.asynchronous=true: the server samples each step's rollout itself"
    yield bool(r.correction.mode) or r.correction.bypass, ("rollout.correction.*: the sampler correction reads the "
                                                           "trainer's full distribution; drop it")
    yield cfg.env.name != "none", f"env={cfg.env.name}: multi-turn episodes are not built for backend=tinker yet"
    yield processes > 1 or cfg.trainer.fsdp, ("several processes (DDP/FSDP): the server is where the parallelism is; "
                                              "launch one process")


def check_backend(cfg, declaration, processes: int) -> None:
    """``backend=tinker``: refuse what the server cannot do (module docstring; the first of the pre-flight's checks
    after the plugin is built, so that no other check loads or asks anything for a run that cannot go on). Nothing for
    ``backend=local``.

    Raises:
        ConfigError: one line, ``backend=tinker cannot run this: <what and why>.``
    """
    if cfg.backend.name != "tinker":
        return
    for refused, why in _refusals(cfg, declaration, processes):
        if refused:
            raise ConfigError(f"backend=tinker cannot run this: {why}.")


def check_backend_server(cfg) -> None:
    """``backend=tinker``: the server answers and serves :func:`base_model_name` for training
    (:func:`prefzoo.tinker.backend.check_server`); nothing for ``backend=local``.

    Raises:
        ConfigError: the tinker SDK not installed, no server at ``backend.url``, not a Tinker server, or another
            model."""
    if cfg.backend.name != "tinker":
        return
    import importlib.util

    if importlib.util.find_spec("tinker") is None:
        raise ConfigError("backend=tinker talks to the server through the tinker SDK, which is not installed: "
                          "pip install 'prefzoo[tinker]'")
    from prefzoo.tinker.backend import check_server

    check_server(cfg.backend.url, base_model_name(cfg), timeout=min(10.0, cfg.backend.timeout))
