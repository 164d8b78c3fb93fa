"""The vLLM server rollout engine (``rollout.engine=vllm_server``): rollouts drawn by N vLLM servers over HTTP.

Each server is vLLM's OpenAI-compatible server with LoRA loading at run time switched on: ``prefzoo serve --model
smollm2 --port 8000`` starts one (:mod:`prefzoo.serve`), on this machine or another one; the trainer is given their
addresses (``rollout.servers=[http://host:8000,http://host2:8000]``) and needs no vLLM of its own, only HTTP.
Nothing else travels: no Ray, no NCCL group between trainer and servers (TRL's ``vllm_mode=server`` and prime-rl
work the same way; TRL measured serving the adapter unmerged at 1.33-1.39x the time per output token of merged
weights, in exchange for no merge and no full-weight transfer).

How a rollout goes (:meth:`VLLMServerEngine.sample`):

1. **Weights** (the main process): the policy version v counts the adapters the servers were given. When any trainable
   tensor changed since the last rollout (an optimizer step, a checkpoint load: the tensors' version counters, as the
   in-process vLLM engine watches them), v goes up by one, the LoRA adapter is saved to
   ``<adapter_dir>/policy-<run>-v<v>`` (peft's format, a few MB) and every live server loads it under that name
   (``POST /v1/load_lora_adapter``); then the previous version is unloaded. The names carry a random id per run, so a
   second or resumed run never meets the names an earlier one left loaded (vLLM refuses a name it holds). So every
   optimizer step reaches the next rollout, and the frozen base weights are never touched. ``adapter_dir`` must be a
   folder every server reads at the same path: any folder on one machine, a shared file system (NFS, Lustre) across
   machines. Other data-parallel processes push nothing: they wait until the servers list the name (``GET
   /v1/models``), which every process computes alike (the same optimizer steps change the same tensors; the run id
   is the launch's, :func:`_shared_run_id`).
2. **Prompts** are split in contiguous, near-equal shares over the live servers; each prompt is one
   ``POST /v1/completions`` request whose ``prompt`` is its token ids (left padding stripped: token in), with
   ``n = num_samples`` and the prompt's seed (:data:`~prefzoo.types.ROLLOUT_SEED_COLUMN`, or one drawn from the
   policy's generator), all in flight at once. With the same seed a prompt's samples do not depend on which server
   drew them.
3. **Sampling**: temperature (greedy: 0), top_p, top_k (-1 when off), ``max_tokens = max_new_tokens``,
   ``stop_token_ids`` = the policy's EOS ids and only those (``ignore_eos``), ``logprobs = 0`` (the log-prob of each
   sampled token, after the temperature: the server runs with ``--logprobs-mode processed_logprobs``, which
   ``prefzoo serve`` sets) and ``return_token_ids`` (token out: the ids, never the text).
4. **Back**: the answer's ``model`` field names the adapter that drew it. A sample of any other policy version than
   the current one is refused (:class:`~prefzoo.errors.ModelError`): the synchronous update assumes the rollout's
   policy is the one being trained. The result is a :class:`~prefzoo.types.SequenceBatch` in the hf engine's layout
   with ``sample_logps``, so the engine/trainer mismatch is logged and, with ``rollout.correction.mode``, corrected,
   as for the in-process vLLM engine.

A server that fails mid-run (refused connection, time-out, an HTTP error other than a bad request): its prompts are
sent to the other live servers, a warning names it, and it gets no more requests or adapters; the run continues on
the others. With none left the run stops with one line (:class:`~prefzoo.errors.ModelError`); its checkpoints, written
between steps, are whole, and ``trainer.resume=true`` continues from the last one once servers are back.

Before any model loads, :func:`check_servers` asks every server what it serves (``GET /v1/models``): one that does
not answer, that serves another base model than the run's (:func:`served_model_name`), whose context is shorter than
the run's prompts and completions, or that cannot load adapters at run time, stops the run with one line.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from prefzoo.text import server_address
from prefzoo.errors import ConfigError, ModelError
from prefzoo.rollout.vllm_engine import completion_batch, prompt_id_lists, request_seeds, trainable_stamp
from prefzoo.types import PromptBatch, SamplingParams, SequenceBatch

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # (it logs every request at INFO: hundreds of lines a run)

__all__ = ["VLLMServerEngine", "check_servers", "served_model_name"]

#: the adapter names the engine gives the servers: ``policy-<run id>-v<version>``
ADAPTER_PREFIX = "policy-"


def _shared_run_id() -> str:
    """A random id for this run's adapter names, the same on every data-parallel process: the launch's
    (``PREFZOO_LAUNCH_ID``, process 0's random token, broadcast when the processes met:
    :func:`prefzoo.training.distributed.setup_data_parallel`; not a collective here, since the engines are built
    one process after the other), else a new one (one process)."""
    import os
    import secrets

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and os.environ.get("PREFZOO_LAUNCH_ID"):
        return os.environ["PREFZOO_LAUNCH_ID"]
    return secrets.token_hex(4)


def served_model_name(name: str, *, tiny_hidden_size: int = 64, tiny_layers: int = 2, seed: int = 0) -> str:
    """The name a server started by ``prefzoo serve`` serves the base model under, and the one a run checks for.

    ``smollm2`` and a hub id or folder keep their name; the tiny model, whose random weights depend on its size and
    seed, is ``tiny-h<hidden>-l<layers>-s<seed>``, so a server built with other weights is not taken for the run's."""
    if name == "tiny":
        return f"tiny-h{tiny_hidden_size}-l{tiny_layers}-s{seed}"
    return name


def _address(url: str, where: str) -> str:
    """``url`` as a server address (:func:`prefzoo.text.server_address`), or a one-line ConfigError naming ``where``."""
    address, problem = server_address(url)
    if problem is not None:
        raise ConfigError(f"{where}={url!r}{problem}")
    return address


def _client(timeout: float):
    import httpx

    return httpx.Client(timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)))


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _one_line(text: str, limit: int = 200) -> str:
    """``text`` (an answer's body: JSON, HTML) as one line of at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def check_servers(urls: list[str], model_name: str, need_tokens: int, timeout: float = 10.0) -> list[dict]:
    """Ask every server what it serves, before any model loads.

    Args:
        urls: the servers' addresses (``rollout.servers``).
        model_name: the base model the run trains, as :func:`served_model_name` names it.
        need_tokens: prompt + completion tokens a request may need (``data.max_prompt_length + max_new_tokens``).
    Returns:
        each server's ``GET /v1/models`` entry of the base model.
    Raises:
        ConfigError: no server given; a server that does not answer, answers something other than vLLM's model list,
            serves another base model, has a shorter context than ``need_tokens``, or cannot load adapters at run time.
    """
    import httpx

    if not urls:
        raise ConfigError("rollout.engine=vllm_server needs rollout.servers=[http://host:port, ...]: start each "
                          "server with `prefzoo serve --model <the run's model.name> --port <port>`.")
    found = []
    with _client(timeout) as http:
        for i, raw in enumerate(urls):
            where = f"rollout.servers[{i}]"
            url = _address(raw, where)
            try:
                answer = http.get(f"{url}/v1/models")
                answer.raise_for_status()
                models = answer.json()["data"]
            except httpx.HTTPError as err:
                port = urlparse(url).port or (443 if url.startswith("https") else 80)
                raise ConfigError(f"{where}={url}: no vLLM server answers there ({_reason(err)}); start one with "
                                  f"`prefzoo serve --model ... --port {port}` or fix the address.") from None
            except (ValueError, KeyError, TypeError):
                models = None
            if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                       for m in models):
                raise ConfigError(f"{where}={url}: GET /v1/models did not answer with vLLM's model list; is it a "
                                  "vLLM server (`prefzoo serve`)?")
            names = {m["id"]: m for m in models}
            if model_name not in names:
                served = ", ".join(sorted(n for n in names if not n.startswith(ADAPTER_PREFIX)))
                if model_name.startswith("tiny-"):
                    fix = ("the run's tiny model is " + model_name + ": start the server with `prefzoo serve --model "
                           "tiny` and the matching --tiny-hidden-size / --tiny-layers / --seed, or set "
                           "model.tiny_hidden_size / model.tiny_layers / trainer.seed to the server's (its name says "
                           "them: tiny-h<hidden>-l<layers>-s<seed>; prefzoo serve's default width is 128)")
                else:
                    fix = "start it with `prefzoo serve --model <the run's model.name>`, or train the model it serves"
                raise ConfigError(f"{where}={url} serves {served or 'nothing'}, not the run's base model "
                                  f"{model_name!r}; {fix}.")
            length = names[model_name].get("max_model_len")
            if isinstance(length, int) and length < need_tokens:
                raise ConfigError(f"{where}={url} serves {model_name!r} with a context of {length} tokens, shorter "
                                  f"than data.max_prompt_length + max_new_tokens = {need_tokens}; restart it with "
                                  f"--max-model-len {need_tokens} or more.")
            try:  # the route exists (405: it takes POST) only when runtime LoRA loading is on
                status = http.get(f"{url}/v1/load_lora_adapter").status_code
            except httpx.HTTPError as err:
                raise ConfigError(f"{where}={url}: stopped answering ({_reason(err)}).") from None
            if status == 404:
                raise ConfigError(f"{where}={url} cannot load LoRA adapters at run time, which is how the trainer "
                                  "sends it each update; start it with `prefzoo serve` (or vLLM with --enable-lora and "
                                  "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).")
            found.append(names[model_name])
    return found


class _ServerDown(Exception):
    """A server failed a request in a way that says it is gone (connection, time-out, server error)."""


class VLLMServerEngine:
    """Samples on vLLM servers over HTTP (see the module docstring).

    Args:
        servers: the servers' base addresses (``http://host:port``), checked by :func:`check_servers` beforehand.
        model_name: the base model's served name (:func:`served_model_name`): the version check's fallback name.
        adapter_dir: where adapters are written for the servers to read (the same path on every server's machine);
            None: a new temporary folder (one machine), removed by :meth:`close`.
        timeout: seconds one request may take (a rollout of many long completions on a slow server: raise it).
        is_main: whether this process pushes the adapters (None: rank 0 of torch.distributed when it is initialised,
            else True).
        wait_seconds: how long another data-parallel process waits for the main process's adapter to appear.
    """

    name = "vllm_server"

    def __init__(self, servers: list[str], *, model_name: str, adapter_dir: str | Path | None = None,
                 timeout: float = 600.0, is_main: bool | None = None, wait_seconds: float = 600.0):
        if not servers:
            raise ConfigError("rollout.engine=vllm_server needs rollout.servers=[http://host:port, ...].")
        self.servers = [_address(s, f"rollout.servers[{i}]") for i, s in enumerate(servers)]
        self.live = list(self.servers)
        self.model_name = model_name
        self._own_dir = adapter_dir is None
        self.adapter_dir = (Path(adapter_dir) if adapter_dir is not None
                            else Path(tempfile.mkdtemp(prefix="prefzoo-adapters-")))
        self.timeout, self.wait_seconds = float(timeout), float(wait_seconds)
        self._is_main = is_main
        # this run's adapter names, policy-<run>-v<version>: a second run (or a resumed one) on the same servers never
        # meets the names an earlier one left loaded; data-parallel processes take the main process's
        self.run_id = _shared_run_id()
        self.version = 0  # the policy version the servers hold (0: none pushed yet)
        self._stamp: tuple | None = None
        self.syncs = 0  # adapters pushed by this process
        self.requests = 0  # completion requests answered
        self._lock = threading.Lock()
        self._http = _client(self.timeout)

    # ------------------------------------------------------------------ helpers
    @property
    def is_main(self) -> bool:
        if self._is_main is None:
            import torch.distributed as dist

            self._is_main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        return self._is_main

    @property
    def adapter_name(self) -> str:
        return f"{ADAPTER_PREFIX}{self.run_id}-v{self.version}"

    def _post(self, url: str, path: str, body: dict) -> dict | str:
        """POST ``body`` to ``url + path``; the answer's JSON (or text). Raises _ServerDown for a server that is gone,
        ModelError for a request the server refused (4xx: a bug or a wrong setting, not a dead server)."""
        import httpx

        try:
            answer = self._http.post(f"{url}{path}", json=body)
        except httpx.HTTPError as err:
            raise _ServerDown(_reason(err)) from None
        if answer.status_code >= 400:
            try:
                message = answer.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text
            if answer.status_code >= 500:
                raise _ServerDown(f"HTTP {answer.status_code}: {_one_line(message)}")
            raise ModelError(f"the vLLM server {url} refused {path} (HTTP {answer.status_code}): "
                             f"{_one_line(message, 300)}")
        try:
            return answer.json()
        except ValueError:
            return answer.text

    def _answers(self, url: str) -> bool:
        """Whether ``url`` still answers its model list."""
        import httpx

        try:
            return self._http.get(f"{url}/v1/models").status_code == 200
        except httpx.HTTPError:
            return False

    def _drop(self, url: str, why: str) -> None:
        with self._lock:
            if url not in self.live:
                return
            self.live.remove(url)
            left = len(self.live)
        if not left:
            raise ModelError(f"the vLLM server {url} stopped answering ({why}) and no other server is left; the run "
                             "stops here (its last checkpoint is whole: restart the servers and rerun with "
                             "trainer.resume=true).")
        log.warning("the vLLM server %s stopped answering (%s); the rollouts continue on the %d other(s)", url, why,
                    left)

    # ------------------------------------------------------------------ weights
    def sync(self, model: nn.Module) -> bool:
        """Push ``model``'s LoRA adapter to the live servers if any trainable tensor changed since the last rollout
        (another data-parallel process: wait until the main process has pushed it). Returns whether the version moved.

        Raises:
            ModelError: ``model`` is not a peft model; no server is left; a server refused the adapter.
        """
        stamp = trainable_stamp(model)
        if stamp == self._stamp and self.version:
            return False
        if not hasattr(model, "save_pretrained") or not hasattr(model, "peft_config"):
            raise ModelError("rollout.engine=vllm_server sends the trained weights to the servers as a LoRA adapter; "
                             "the policy is not a peft model (model.lora.enabled=true).")
        previous = self.adapter_name if self.version else None
        self.version += 1
        self._stamp = stamp
        if not self.is_main:
            self._wait_for(self.adapter_name)
            return True
        folder = self.adapter_dir / self.adapter_name
        model.save_pretrained(str(folder))
        for url in list(self.live):
            try:
                self._post(url, "/v1/load_lora_adapter",
                           {"lora_name": self.adapter_name, "lora_path": str(folder.resolve())})
            except _ServerDown as err:
                if self._answers(url):  # up, but it could not load this adapter: the run's setting, not a dead server
                    raise ModelError(f"the vLLM server {url} failed to load the adapter ({err}); is model.lora.r above "
                                     "the server's --max-lora-rank? Restart it with `prefzoo serve --max-lora-rank "
                                     "<at least model.lora.r>`.") from None
                self._drop(url, str(err))
        self.syncs += 1
        if previous is not None:
            for url in list(self.live):
                try:
                    self._post(url, "/v1/unload_lora_adapter", {"lora_name": previous})
                except (_ServerDown, ModelError) as err:  # the new one is loaded: the old one only takes memory
                    log.debug("unloading %s from %s failed: %s", previous, url, err)
            shutil.rmtree(self.adapter_dir / previous, ignore_errors=True)
        return True

    def _wait_for(self, name: str) -> None:
        """Another data-parallel process: wait until every live server lists adapter ``name``."""
        import time

        import httpx

        deadline = time.monotonic() + self.wait_seconds
        for url in list(self.live):
            while True:
                try:
                    listed = {m.get("id") for m in self._http.get(f"{url}/v1/models").json().get("data", [])}
                except (httpx.HTTPError, ValueError, AttributeError) as err:
                    self._drop(url, _reason(err))
                    break
                if name in listed:
                    break
                if time.monotonic() > deadline:
                    raise ModelError(f"the vLLM server {url} did not get adapter {name} from the main process within "
                                     f"{self.wait_seconds:.0f} s; did the main process stop?")
                time.sleep(0.2)

    # ----------------------------------------------------------------- sampling
    @staticmethod
    def _body(params: SamplingParams, num_samples: int, eos_token_ids: list[int]) -> dict:
        stop = [int(i) for i in eos_token_ids if int(i) >= 0]  # (a negative id, "never stop", is never sampled)
        body = dict(n=num_samples, max_tokens=params.max_new_tokens, stop_token_ids=stop, ignore_eos=True, logprobs=0,
                    return_token_ids=True, skip_special_tokens=False)
        if params.greedy:
            body.update(temperature=0.0)
        else:
            body.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k else -1)
        return body

    def _complete(self, url: str, ids: list[int], seed: int, body: dict, num_samples: int) -> tuple[list, list]:
        """One prompt's samples from ``url``: (token id lists, log-prob lists)."""
        answer = self._post(url, "/v1/completions", {**body, "model": self.adapter_name, "prompt": ids,
                                                     "seed": seed % (2 ** 31)})
        if not isinstance(answer, dict) or "choices" not in answer:
            raise _ServerDown(f"an answer without completions: {_one_line(answer)}")
        if answer.get("model") != self.adapter_name:
            raise ModelError(f"the vLLM server {url} answered with {answer.get('model')!r}, not the current policy "
                             f"version {self.adapter_name!r}: its samples would come from another policy than the one "
                             "trained; is another trainer pushing adapters to it?")
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != num_samples:
            raise ModelError(f"the vLLM server {url} returned {len(choices)} completions for a prompt; asked for "
                             f"{num_samples}.")
        tokens, logps = [], []
        for c in choices:
            ids_out = c.get("token_ids")
            if ids_out is None:
                raise ModelError(f"the vLLM server {url} returned no token ids (return_token_ids); vLLM 0.10.2 or "
                                 "newer is needed.")
            lp = (c.get("logprobs") or {}).get("token_logprobs")
            if lp is None or len(lp) != len(ids_out):
                raise ModelError(f"the vLLM server {url} returned {0 if lp is None else len(lp)} log-probs for "
                                 f"{len(ids_out)} tokens.")
            tokens.append([int(t) for t in ids_out])
            logps.append([float(x) if x is not None else 0.0 for x in lp])
        with self._lock:
            self.requests += 1
        return tokens, logps

    def _assign(self, n_prompts: int) -> list[str]:
        """The server of each prompt: contiguous, near-equal shares over the live servers."""
        live = list(self.live)
        return [live[i * len(live) // max(1, n_prompts)] for i in range(n_prompts)]

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
               eos_token_ids: list[int], pad_id: int, generator: torch.Generator | None = None) -> SequenceBatch:
        """``num_samples`` completions per prompt from the servers, with ``model``'s current adapter (pushed first if
        it changed). Raises ModelError when no server is left or a sample is of another policy version."""
        self.sync(model)
        ids = prompt_id_lists(prompts)
        seeds = request_seeds(prompts, generator)
        body = self._body(params, num_samples, list(eos_token_ids))
        results: list[tuple[list, list] | None] = [None] * len(ids)
        todo = list(range(len(ids)))
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(ids)))) as pool:
            while todo:
                if not self.live:
                    raise ModelError("no vLLM server is left to sample from.")
                where = self._assign(len(todo))
                futures = {i: (url, pool.submit(self._complete, url, ids[i], seeds[i], body, num_samples))
                           for i, url in zip(todo, where)}
                todo = []
                for i, (url, future) in futures.items():
                    try:
                        results[i] = future.result()
                    except _ServerDown as err:
                        self._drop(url, str(err))
                        todo.append(i)
        completions = [t for r in results for t in r[0]]
        logps = [lp for r in results for lp in r[1]]
        return completion_batch(prompts, num_samples, completions, logps, list(eos_token_ids), pad_id)

    def close(self) -> None:
        """Close the HTTP client; remove the adapters folder when the engine made it (the servers keep serving)."""
        self._http.close()
        if self._own_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
