"""``prefzoo serve``: a vLLM server the trainer can drive (``rollout.engine=vllm_server``, docs/scaling-out.md), or,
with ``--api tinker``, prefzoo's own server of the Tinker training API (docs/tinker.md).

    prefzoo serve --model smollm2 --port 8000
    prefzoo serve --model tiny --tiny-hidden-size 128 --seed 0 --port 8001
    prefzoo serve --model /models/my-8b --port 8000 --dtype bfloat16 -- --tensor-parallel-size 2

A thin wrapper over vLLM's OpenAI-compatible server. It resolves ``--model`` as a run resolves ``model.name``
(``smollm2``: the converted safetensors in prefzoo's cache, converted once; ``tiny``: the random tiny model of that
size and seed, saved once to the cache; a folder or a hub id as given), then REPLACES itself with vLLM's server on that
folder (the same process: stopping it stops the server), started with what the trainer relies on:

* ``--served-model-name`` :func:`prefzoo.rollout.vllm_server.served_model_name`: the name the run checks for, so a
  server on another base model (or another tiny model) is refused before training;
* ``--enable-lora --max-lora-rank R --max-loras 2`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: the trainer
  loads each new adapter (``/v1/load_lora_adapter``) before it unloads the previous one, so two are held for a moment;
* ``--logprobs-mode processed_logprobs``: the log-probs of the sampled tokens after the temperature (and top-k /
  top-p), as the trainer recomputes them;
* ``--dtype``, ``--max-model-len``, ``--seed``, ``--host``, ``--port``; on a machine without CUDA (vLLM's CPU build)
  the KV cache size (``VLLM_CPU_KVCACHE_SPACE``) and, with ``--threads``, that many OpenMP threads unbound to cores.

``--api tinker`` starts :mod:`prefzoo.tinker.server` in this process instead, on the same ``--model`` folder:
``--checkpoint-dir`` (where ``save_state`` writes adapters), ``--session-timeout`` (seconds without a heartbeat before
a client's models are freed), ``--max-models`` (training models held at once), ``--host``, ``--port``, ``--seed``;
vLLM's options and anything after ``--`` are refused there.

    prefzoo serve --api tinker --model tiny --port 8000 --checkpoint-dir runs/tinker

Anything after ``--`` goes to vLLM unchanged, except the options listed above, which prefzoo serve sets itself (refused
there in one line, naming the option to use). ``--print-command`` prints the command and the environment it would
run, and starts nothing (nor converts or builds the model).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

from prefzoo.errors import PrefzooError

__all__ = ["main", "server_command"]

#: vLLM's OpenAI-compatible server, newest module first (``vllm serve`` itself fails on vLLM's CPU build, whose
#: distribution is named vllm-cpu: its version lookup of "vllm" raises)
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the project's rule), not a usage block."""

    def error(self, message: str):
        raise PrefzooError(f"{message} (prefzoo serve --help lists the options)")


#: vLLM options prefzoo serve sets itself (the trainer relies on them): refused after ``--``, with the option to use
RESERVED = {"--model": "use --model", "--served-model-name": "it follows from --model, the name the run checks",
            "--enable-lora": "always on", "--max-lora-rank": "use --max-lora-rank",
            "--max-loras": "always 2: the trainer loads the next adapter before unloading the last",
            "--logprobs-mode": "always processed_logprobs: the log-probs the trainer recomputes",
            "--dtype": "use --dtype", "--max-model-len": "use --max-model-len", "--seed": "use --seed",
            "--host": "use --host", "--port": "use --port"}


#: options only vLLM's server uses: refused with ``--api tinker`` when set to anything but their default
VLLM_ONLY = ("dtype", "max_lora_rank", "max_model_len", "cpu_kv_cache_gib", "threads", "print_command")


def _check_tinker(args: argparse.Namespace, extra: list[str]) -> None:
    """``--api tinker``: no vLLM option, no ``--`` options, a positive timeout and model count, a checkpoint folder
    that is not a file; PrefzooError otherwise."""
    defaults = _parser().parse_args([])
    for name in VLLM_ONLY:  # (their defaults are never None: a given value differs from it)
        if getattr(args, name) != getattr(defaults, name):
            raise PrefzooError(f"--{name.replace('_', '-')} is an option of vLLM's server; --api tinker serves the "
                               "model in this process (drop it, or use --api vllm).")
    if extra:
        raise PrefzooError(f"{' '.join(extra)} after --: --api tinker passes nothing on (those go to vLLM's server).")
    if not args.session_timeout > 0:
        raise PrefzooError(f"--session-timeout {args.session_timeout}: must be > 0 seconds (the SDK beats every 10 s; "
                           "60 is the default).")
    if args.max_models < 1:
        raise PrefzooError(f"--max-models {args.max_models}: must be >= 1.")
    if Path(args.checkpoint_dir).expanduser().is_file():
        raise PrefzooError(f"--checkpoint-dir {args.checkpoint_dir}: is a file; give a folder (created if missing).")


def _check(args: argparse.Namespace, extra: list[str]) -> None:
    """Ranges of the options, the model folder, and no reserved vLLM option after ``--``; PrefzooError otherwise."""
    for name, low, high in (("port", 1, 65535), ("max_lora_rank", 1, None), ("max_model_len", 1, None),
                            ("cpu_kv_cache_gib", 1, None), ("threads", 0, None), ("seed", 0, None),
                            ("tiny_layers", 1, None), ("tiny_hidden_size", 1, None)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            raise PrefzooError(f"--{name.replace('_', '-')} {value}: must be {bound}.")
    if args.model == "tiny" and args.tiny_hidden_size % 4:
        raise PrefzooError(f"--tiny-hidden-size {args.tiny_hidden_size}: the tiny model has 4 attention heads, so a "
                           "multiple of 4 (vLLM's CPU attention also needs a head size of 32 or more: 128).")
    looks_like_path = args.model.startswith((".", "/", "~")) or "\\" in args.model
    folder = Path(args.model).expanduser()
    if args.model not in ("smollm2", "tiny") and looks_like_path and not (folder / "config.json").is_file():
        raise PrefzooError(f"--model {args.model}: no model folder there (no config.json); give a folder holding a "
                           "Hugging Face model, a hub id, smollm2 or tiny.")
    for item in extra:
        flag = item.split("=", 1)[0]
        if flag in RESERVED:
            raise PrefzooError(f"{item} after --: prefzoo serve sets {flag} itself ({RESERVED[flag]}).")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="prefzoo serve", description="A vLLM server a prefzoo run samples from "
                "(rollout.engine=vllm_server rollout.servers=[http://HOST:PORT]).")
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model folder | a hub id (as model.name)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest model.lora.r a run may send (vLLM "
                   "accepts 1, 8, 16, 32, 64, 128, 256, 320, 512; a rank in between is rounded up)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens per request")
    p.add_argument("--seed", type=int, default=0, help="vLLM's own seed; model tiny: its weights' seed (the run's "
                   "trainer.seed)")
    p.add_argument("--tiny-hidden-size", type=int, default=None, help="model tiny: its width (default 128 with "
                   "--api vllm: vLLM's CPU attention needs a head size of 32 or more, 128 with 4 heads; 64 with --api "
                   "tinker, model=tiny's width in a run)")
    p.add_argument("--tiny-layers", type=int, default=2)
    p.add_argument("--cpu-kv-cache-gib", type=int, default=1, help="without CUDA: the KV cache's size in GiB")
    p.add_argument("--threads", type=int, default=0, help="without CUDA: OpenMP threads of the engine, unbound to "
                   "cores (0: vLLM's default, which binds them)")
    p.add_argument("--print-command", action="store_true", help="print the command and its environment; start nothing")
    p.add_argument("--api", default="vllm", choices=("vllm", "tinker"), help="vllm: vLLM's OpenAI server (for "
                   "rollout.engine=vllm_server); tinker: prefzoo's Tinker training API server (docs/tinker.md)")
    p.add_argument("--checkpoint-dir", default="tinker-checkpoints", help="--api tinker: where save_state and "
                   "save_weights_for_sampler write adapters (tinker://RUN/weights/NAME is RUN/weights/NAME here)")
    p.add_argument("--session-timeout", type=float, default=60.0, help="--api tinker: seconds without a heartbeat "
                   "after which a client's session ends and its models are freed")
    p.add_argument("--max-models", type=int, default=4, help="--api tinker: training models held at once")
    return p


def model_folder(name: str, *, seed: int, tiny_hidden_size: int, tiny_layers: int, build: bool = True) -> str:
    """The folder (or hub id) vLLM loads for ``--model name``: as a run resolves ``model.name``; ``build``: convert
    SmolLM2 / build the tiny model there if missing (False: only say where)."""
    from prefzoo.models.loading import (SMOLLM2_CACHE_NAME, atomic_save, cache_dir, load_causal_lm, load_tokenizer,
                                        smollm2_local_dir)

    if name == "smollm2":
        return str(smollm2_local_dir()) if build else str(cache_dir() / SMOLLM2_CACHE_NAME)
    if name == "tiny":
        folder = cache_dir() / "served" / f"tiny-h{tiny_hidden_size}-l{tiny_layers}-s{seed}"
        if build and not (folder / "config.json").is_file():
            tokenizer = load_tokenizer("tiny")
            model = load_causal_lm("tiny", seed=seed, tokenizer=tokenizer,
                                   tiny_kwargs={"hidden_size": tiny_hidden_size, "num_layers": tiny_layers})

            def save(tmp) -> None:
                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)

            atomic_save(folder, save)  # two servers started at once on a fresh cache both build it
        return str(folder)
    return name


def server_command(args: argparse.Namespace, extra: list[str], folder: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment additions) of vLLM's server for ``args`` on ``folder``."""
    from prefzoo.rollout.vllm_engine import lora_rank_for_vllm
    from prefzoo.rollout.vllm_server import served_model_name

    module = next((m for m in SERVER_MODULES if _module_exists(m)), SERVER_MODULES[-1])
    try:
        rank = lora_rank_for_vllm(args.max_lora_rank)
    except PrefzooError:
        raise PrefzooError(f"--max-lora-rank {args.max_lora_rank}: vLLM serves LoRA ranks up to 512.") from None
    name = served_model_name(args.model, tiny_hidden_size=args.tiny_hidden_size, tiny_layers=args.tiny_layers,
                             seed=args.seed)
    argv = [sys.executable, "-m", module, "--model", folder, "--served-model-name", name,
            "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2",
            "--logprobs-mode", "processed_logprobs", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--seed", str(args.seed), "--host", args.host, "--port", str(args.port), *extra]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    import torch

    if not torch.cuda.is_available():  # vLLM's CPU build
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.cpu_kv_cache_gib)
        if args.threads:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(args.threads))
    return argv, env


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _serve_tinker(args: argparse.Namespace) -> int:
    """``--api tinker``: build the model folder, then serve the Tinker API on it in this process until interrupted."""
    missing = [m for m in ("tinker", "fastapi", "uvicorn") if not _module_exists(m)]
    if missing:
        raise PrefzooError(f"--api tinker needs the tinker extra ({', '.join(missing)} not installed): "
                           "pip install 'prefzoo[tinker]'")
    from prefzoo.tinker.local import make_server, serve_forever

    folder = model_folder(args.model, seed=args.seed, tiny_hidden_size=args.tiny_hidden_size,
                          tiny_layers=args.tiny_layers)
    server = make_server(args.model, folder, Path(args.checkpoint_dir).expanduser(), seed=args.seed,
                         max_models=args.max_models, session_timeout=args.session_timeout)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"prefzoo serve: the Tinker API on {args.model} ({folder}) at http://{host}:{args.port} (tinker."
          f"ServiceClient(base_url=\"http://{host}:{args.port}\", api_key=\"tml-local\"); checkpoints in "
          f"{args.checkpoint_dir})", flush=True)
    serve_forever(server, args.host, args.port)
    return 0


def main(argv: list[str]) -> int:
    """``prefzoo serve [options] [-- vLLM options]``: start the server (this process becomes it), or print it."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    try:
        args = _parser().parse_args(ours)
        if args.tiny_hidden_size is None:
            args.tiny_hidden_size = 64 if args.api == "tinker" else 128
        _check(args, [] if args.api == "tinker" else extra)
        if args.api == "tinker":
            _check_tinker(args, extra)
            return _serve_tinker(args)
        if not args.print_command and importlib.util.find_spec("vllm") is None:
            from prefzoo.config import VLLM_INSTALL

            raise PrefzooError(f"prefzoo serve runs vLLM's server, and vLLM is not installed in this Python "
                               f"({sys.executable}): {VLLM_INSTALL}.")
        folder = model_folder(args.model, seed=args.seed, tiny_hidden_size=args.tiny_hidden_size,
                              tiny_layers=args.tiny_layers, build=not args.print_command)
        command, env = server_command(args, extra, folder)
    except PrefzooError as err:
        print(f"prefzoo serve: error: {err}", file=sys.stderr)
        return 2
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(command)
    if args.print_command:
        print(shown)
        return 0
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    print(f"prefzoo serve: {command[command.index('--served-model-name') + 1]} from {folder} on {url} (train with "
          f"rollout.engine=vllm_server rollout.servers=[{url}])\n  {shown}", flush=True)
    os.execve(command[0], command, {**os.environ, **env})
    return 0  # (not reached)


if __name__ == "__main__":  # pragma: no cover - python -m prefzoo.serve
    raise SystemExit(main(sys.argv[1:]))
