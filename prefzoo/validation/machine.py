"""The pre-flight's checks that look at the machine: the rollout engine's package installed, the vLLM servers answer."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from prefzoo.errors import ConfigError

log = logging.getLogger("prefzoo.config")

__all__ = ['check_rollout_servers', 'check_engine_installed']


def check_rollout_servers(cfg) -> None:
    """``rollout.engine=vllm_server``: ask each server in ``rollout.servers`` what it serves, before any model loads
    (:func:`prefzoo.rollout.vllm_server.check_servers`); nothing for the other engines.

    Raises:
        ConfigError: a server that does not answer, serves another base model, has too short a context, or cannot
            load adapters at run time (one line naming ``rollout.servers[i]`` and the fix).
    """
    r = cfg.rollout
    if r.engine != "vllm_server":
        return
    from prefzoo.rollout.vllm_server import check_servers, served_model_name

    folder = r.vllm.adapter_dir
    if folder is not None:  # the adapters are written here: a folder this process can write (made if missing)
        from pathlib import Path

        path = Path(folder).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            ok = path.is_dir() and os.access(path, os.W_OK)
        except OSError:
            ok = False
        if not ok:
            raise ConfigError(f"rollout.vllm.adapter_dir={folder!r} is not a folder this process can write; give a "
                              "writable folder every server reads at the same path (a shared file system across "
                              "machines), or drop it for a temporary one (servers on this machine).")
    m = cfg.model
    name = served_model_name(m.name, tiny_hidden_size=m.tiny_hidden_size, tiny_layers=m.tiny_layers, seed=cfg.trainer.seed)
    check_servers(list(r.servers), name, cfg.data.max_prompt_length + max(r.max_new_tokens, cfg.eval.max_new_tokens))


def check_engine_installed(cfg) -> None:
    """``rollout.engine=vllm`` needs vLLM in this Python (``vllm_server``'s servers run it elsewhere), and a LoRA rank
    it serves (:func:`prefzoo.rollout.vllm_engine.lora_rank_for_vllm`).

    Raises:
        ConfigError: the rank is above what vLLM serves; vLLM is not installed (the message gives the install command).
    """
    from prefzoo.config import VLLM_INSTALL

    if cfg.rollout.engine != "vllm":
        return
    if cfg.model.lora.enabled:
        from prefzoo.rollout.vllm_engine import lora_rank_for_vllm

        lora_rank_for_vllm(cfg.model.lora.r)
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed in this Python ({sys.executable}): "
                          f"{VLLM_INSTALL}; or use rollout.engine=hf (or vllm_server, whose servers run vLLM "
                          "elsewhere).")
