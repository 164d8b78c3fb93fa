"""``backend=tinker``: prefzoo's plugins training through a Tinker server (hosted Tinker, ``prefzoo serve --api tinker``,
any server of the API), with the pinned ``tinker`` SDK.

What runs where. The server holds the weights (a LoRA adapter over ``backend.base_model``), its optimizer and its
sampler; prefzoo keeps the data, the rewards, the plugin's loss and the schedule. One training step:

1. the rollout: the current weights go to a sampling client (``save_weights_and_get_sampling_client``, once after every
   optimizer step) and each prompt is sampled there (``sample``, ``num_samples`` per prompt, the prompt's rollout seed as
   the request's ``seed``, the tokenizer's EOS ids as ``stop``);
2. the loss, locally: :meth:`TinkerPolicy.logps` asks the server for the per-token log-probs of the rows (``forward``)
   and hands the plugin a LEAF tensor with ``requires_grad``: the plugin's loss, the one normaliser and ``backward``
   run in this process exactly as for a local model, and leave dL/dlogp in the leaf's ``grad``;
3. the update, on the server: :meth:`TinkerOptimizer.step` sends every row of the optimizer step with
   ``weights = -dL/dlogp`` to ``forward_backward`` with the built-in ``cross_entropy`` loss, whose value is
   ``sum_t -weights_t * logp_t`` (the SDK's convention: a SUM over the datum's target tokens), so its gradient with
   respect to the weights is ``sum_t dL/dlogp_t * dlogp_t/dtheta = dL/dtheta``: the chain rule split at the log-probs.
   This is the SDK's own ``forward_backward_custom`` route (:meth:`tinker.TrainingClient.forward_backward_custom`),
   taken apart so that the prefzoo loop keeps its micro-batches and normaliser. Then ``optim_step`` with
   :class:`tinker.types.AdamParams` from the run's config: ``trainer.lr`` as the schedule gives it for this optimizer
   step, torch AdamW's betas (0.9, 0.999) and eps 1e-8 (the SDK's defaults are 0.95 and 1e-12: prefzoo sends its
   own, so a local and a remote run take the same step), ``trainer.weight_decay``, ``trainer.max_grad_norm`` as
   ``grad_clip_norm`` (the server clips the global norm of its adapter's gradient).

What the server cannot give is refused before anything loads (:func:`prefzoo.validation.check_backend`): log-probs at a
temperature other than 1 or a per-token entropy (both need the full vocabulary, the server returns the log-prob of the
target token only), full-vocabulary losses (distillation), a value head, the vLLM engines, several processes.
A reference pi_ref (beta > 0, the drift metrics) is the base model's log-probs from a sampling client on
``backend.base_model`` (``compute_logprobs``: prompt log-probs of prompt + completion): the API's base-model sampler.

Checkpoints: the server's ``save_state`` (weights and optimizer), its ``tinker://`` path written in the run folder
(``<weights>/tinker_checkpoint.json``); a resume creates the training client from that state
(``create_training_client_from_state_with_optimizer``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import Tensor

from prefzoo.errors import ConfigError, ModelError
from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SamplingParams, SequenceBatch

log = logging.getLogger(__name__)

__all__ = ["TinkerSession", "TinkerPolicy", "TinkerOptimizer", "RemoteWeights", "check_server", "connect",
           "CHECKPOINT_FILE", "LOCAL_API_KEY", "ADAM_BETAS", "ADAM_EPS"]

#: what a remote run writes in place of weights: the server's ``tinker://`` path of its state
CHECKPOINT_FILE = "tinker_checkpoint.json"
#: the API key sent when ``TINKER_API_KEY`` is not set (a local server accepts any ``tml-`` key)
LOCAL_API_KEY = "tml-prefzoo-local"
#: torch.optim.AdamW's defaults, the local trainer's optimizer: sent with every optim_step
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def api_key() -> str:
    """``TINKER_API_KEY`` from the environment (never written into the run's config), else :data:`LOCAL_API_KEY`."""
    return os.environ.get("TINKER_API_KEY") or LOCAL_API_KEY


def check_server(url: str, base_model: str, timeout: float = 10.0) -> None:
    """Before any model loads: the server at ``url`` answers and serves ``base_model`` for training and sampling.

    Raises:
        ConfigError: nothing listens at ``url`` (a TCP connection within ``timeout`` seconds), the server does not
            answer the capabilities request, or it does not list ``base_model`` (the message lists what it serves).
    """
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            pass
    except OSError as err:
        raise ConfigError(f"backend.url={url}: no server answers there ({err.__class__.__name__}: {err}); start one "
                          "(`prefzoo serve --api tinker --model tiny`) or give the right address.") from None
    import tinker

    try:
        caps = tinker.RestClient(base_url=url, api_key=api_key()).get_server_capabilities().result(timeout=timeout)
    except Exception as err:  # noqa: BLE001 -- the SDK raises its own kinds (status, connection, timeout)
        first = str(err).splitlines()[0] if str(err) else err.__class__.__name__
        raise ConfigError(f"backend.url={url}: the server does not answer Tinker's capabilities request ({first}); "
                          "is it a Tinker API server?") from None
    names = [m.model_name for m in caps.supported_models if m.model_name]
    if base_model not in names:
        served = ", ".join(names) or "no model"
        raise ConfigError(f"backend.base_model={base_model!r}: the server at {url} serves {served}; set "
                          "backend.base_model to one of them.")
    model = next(m for m in caps.supported_models if m.model_name == base_model)
    if model.trainable is False:
        raise ConfigError(f"backend.base_model={base_model!r}: the server at {url} samples it but does not train it.")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def wait(future, timeout: float, what: str, url: str):
    """``future.result(timeout)``; a failure of the server or the connection (after the SDK's own retries) becomes one
    :class:`~prefzoo.errors.ModelError` line naming the request and the server (the command line adds how to resume).

    Raises:
        ModelError: the request failed or timed out."""
    try:
        return future.result(timeout=timeout)
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 -- the SDK's and the transport's own kinds
        raise ModelError(f"backend=tinker: {what} failed on {url} ({_first_line(err)})") from None


# ------------------------------------------------------------------------------------------- rows <-> datums
class _Row:
    """One row of a :class:`SequenceBatch` as the server sees it: its tokens (prompt + completion, no padding), the
    number of prompt tokens, and the completion columns that hold a token."""

    __slots__ = ("tokens", "prompt_len", "columns")

    def __init__(self, batch: SequenceBatch, i: int):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]].tolist()
        if not prompt:  # (the first completion token would have no context to be scored in)
            raise ModelError(f"backend=tinker: row {i} has no prompt token; the server scores a token given those "
                             "before it.")
        held = batch.completion_tokens[i]
        self.columns = torch.nonzero(held, as_tuple=False).flatten().tolist()
        self.tokens = prompt + batch.completion_ids[i][held].tolist()
        self.prompt_len = len(prompt)

    def targets(self) -> list[int]:
        """Indices into the datum's target tokens (``tokens[1:]``) of the completion columns, in order."""
        return [self.prompt_len - 1 + k for k in range(len(self.columns))]

    def datum(self, weights: list[float] | None = None):
        from tinker import types

        n = len(self.tokens) - 1
        w = torch.zeros(n, dtype=torch.float32) if weights is None else torch.tensor(weights, dtype=torch.float32)
        return types.Datum(model_input=types.ModelInput.from_ints(self.tokens[:-1]),
                           loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor(self.tokens[1:])),
                                           "weights": types.TensorData.from_torch(w)})


def _rows(batch: SequenceBatch) -> list[_Row]:
    return [_Row(batch, i) for i in range(len(batch.completion_ids))]


def _per_token(rows: list[_Row], per_row: list[list[float]], batch: SequenceBatch, offset: int) -> Tensor:
    """(B, T) float32 of the per-row log-prob lists: row i's completion column k from ``per_row[i][targets[k] +
    offset]``, 0 where ``completion_mask`` is False."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float32)
    for i, (row, values) in enumerate(zip(rows, per_row)):
        for col, t in zip(row.columns, row.targets()):
            out[i, col] = float(values[t + offset])
    return out.masked_fill(~batch.completion_mask.cpu(), 0.0)


# ------------------------------------------------------------------------------------------------ the session
class TinkerSession:
    """One training run on a Tinker server: the training client, the sampling client of the current weights
    (refreshed lazily after each optimizer step), the base model's sampling client (the reference), and the tape of
    the log-prob leaves whose gradients the next optimizer step sends.

    Args:
        url: the server (``backend.url``); base_model: its name of the model (``backend.base_model``); rank: the LoRA
            rank (``model.lora.r``); seed: the adapter's initialisation seed (``trainer.seed``); reference: build the
            base-model sampler (pi_ref); resume_path: a ``tinker://`` state to start from (weights and optimizer);
            timeout: seconds to wait for one server result.
    """

    def __init__(self, url: str, base_model: str, rank: int, seed: int, reference: bool,
                 resume_path: str | None = None, timeout: float = 600.0):
        import tinker

        self.url, self.base_model, self.timeout = url, base_model, timeout
        self.service = tinker.ServiceClient(base_url=url, api_key=api_key())
        if resume_path is None:
            # prefzoo's target_modules="all-linear" (peft's: every linear layer but the output layer)
            created = self.service.create_lora_training_client(base_model=base_model, rank=rank, seed=seed,
                                                               train_unembed=False)
            self.training = wait(created, timeout, "create_lora_training_client", url)
        else:
            self.training = wait(self.service.create_training_client_from_state_with_optimizer(resume_path), timeout,
                                 f"the resume from {resume_path}", url)
        self.reference = (wait(self.service.create_sampling_client(base_model=base_model), timeout,
                               "the base model's sampling client", url) if reference else None)
        self._sampler = None  # the sampling client of the current weights; None: stale (an optimizer step since)
        self.tape: list[tuple[list[_Row], Tensor]] = []  # this optimizer step's (rows, log-prob leaf) of the loss
        self.run_id = uuid.uuid4().hex[:8]
        self.saves = 0
        self.grad_norms: list[float] = []  # each optim_step's gradient norm before clipping, where the server gives one

    # ------------------------------------------------------------------------------------------- log-probs
    def forward_logps(self, batch: SequenceBatch) -> tuple[list[_Row], Tensor]:
        """The rows of ``batch`` and their per-token log pi_theta (temperature 1), Shape (B, T) float32, no grad."""
        rows = _rows(batch)
        out = wait(self.training.forward([r.datum() for r in rows], "cross_entropy"), self.timeout, "forward", self.url)
        values = [o["logprobs"].to_torch().flatten().tolist() for o in out.loss_fn_outputs]
        return rows, _per_token(rows, values, batch, 0)

    def reference_logps(self, batch: SequenceBatch) -> Tensor:
        """Per-token log pi_ref (the base model) of ``batch``'s completions, Shape (B, T) float32: the base sampler's
        prompt log-probs of prompt + completion (entry j scores token j given tokens < j; entry 0 is None)."""
        rows = _rows(batch)
        from tinker import types

        futures = [self.reference.compute_logprobs(types.ModelInput.from_ints(r.tokens)) for r in rows]
        values = [wait(f, self.timeout, "compute_logprobs (the reference)", self.url) for f in futures]
        return _per_token(rows, values, batch, 1)

    # ----------------------------------------------------------------------------------------------- update
    def apply(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
              grad_clip_norm: float) -> bool:
        """Send the tape's gradients (``weights = -dL/dlogp``, ``cross_entropy``) and take one Adam step on the
        server; the tape is emptied. Returns False (no request) when no leaf received a gradient, as torch's AdamW
        skips parameters without one."""
        from tinker import types

        datums = []
        for rows, leaf in self.tape:
            if leaf.grad is None:
                continue
            grad = leaf.grad.detach().to(torch.float32).cpu()
            for i, row in enumerate(rows):
                weights = [0.0] * (len(row.tokens) - 1)
                for col, t in zip(row.columns, row.targets()):
                    weights[t] = -float(grad[i, col])
                datums.append(row.datum(weights))
        self.tape = []
        if not datums:
            return False
        fb = self.training.forward_backward(datums, "cross_entropy")
        step = self.training.optim_step(types.AdamParams(learning_rate=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                                                         weight_decay=weight_decay, grad_clip_norm=grad_clip_norm))
        wait(fb, self.timeout, "forward_backward", self.url)
        metrics = wait(step, self.timeout, "optim_step", self.url).metrics or {}
        norm = metrics.get("grad_norm:mean", metrics.get("grad_norm"))
        if norm is not None:
            self.grad_norms.append(float(norm))
        self._sampler = None
        return True

    # --------------------------------------------------------------------------------------------- sampling
    def sampler(self):
        """The sampling client of the current weights (saved for the sampler once after each optimizer step)."""
        if self._sampler is None:
            self._sampler = wait(self.training.save_weights_and_get_sampling_client(), self.timeout,
                                 "save_weights_and_get_sampling_client", self.url)
        return self._sampler

    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams, seeds: list[int],
               eos_token_ids: list[int], pad_id: int) -> SequenceBatch:
        """``num_samples`` completions of each prompt from the server's sampler, in prefzoo's rollout layout (rows
        [i*G, (i+1)*G) answer prompt i, right-padded after the first EOS, the EOS counted; ``truncated`` rows ended at
        ``max_new_tokens``). Prompt i's request carries ``seeds[i]``."""
        from tinker import types

        sampler = self.sampler()
        futures = []
        for i in range(len(prompts.prompt_ids)):
            ids = prompts.prompt_ids[i][prompts.prompt_mask[i]].tolist()
            sp = types.SamplingParams(max_tokens=params.max_new_tokens, seed=int(seeds[i]), stop=list(eos_token_ids),
                                      temperature=0.0 if params.greedy else float(params.temperature),
                                      top_k=params.top_k if params.top_k > 0 else -1, top_p=float(params.top_p))
            futures.append(sampler.sample(types.ModelInput.from_ints(ids), num_samples, sp))
        completions, finished = [], []
        for f in futures:
            for seq in wait(f, self.timeout, "sample", self.url).sequences:
                tokens = list(seq.tokens)
                end = next((k for k, t in enumerate(tokens) if t in eos_token_ids), None)
                completions.append(tokens if end is None else tokens[:end + 1])
                # (a server that stopped on the EOS without returning it: finished, its EOS not counted)
                finished.append(end is not None or seq.stop_reason == "stop")
        n_prompts = len(prompts.prompt_ids)
        width = max((len(c) for c in completions), default=0)
        ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(completions), width), dtype=torch.bool)
        for r, c in enumerate(completions):
            ids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
            mask[r, :len(c)] = True
        device = prompts.prompt_ids.device
        return SequenceBatch(prompt_ids=prompts.prompt_ids.repeat_interleave(num_samples, dim=0),
                             prompt_mask=prompts.prompt_mask.repeat_interleave(num_samples, dim=0),
                             completion_ids=ids.to(device), completion_mask=mask.to(device),
                             prompt_index=torch.arange(n_prompts, device=device).repeat_interleave(num_samples),
                             truncated=~torch.tensor(finished, dtype=torch.bool, device=device))

    def close(self, status: str = "success") -> None:
        """End the session (``success``, ``errored`` or ``interrupted``): the server frees its models; the states saved
        stay. Idempotent; a server that is gone already is not an error here."""
        if self.service is None:
            return
        service, self.service = self.service, None
        try:
            service.close(status).result(timeout=min(30.0 if status == "success" else 5.0, self.timeout))
        except Exception as err:  # noqa: BLE001 -- closing must not hide the run's own outcome
            log.warning("backend=tinker: the session did not close cleanly (%s)", str(err).splitlines()[0] if str(err)
                        else type(err).__name__)

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_state(self) -> str:
        """The server's ``save_state`` (weights and optimizer) under a name of this run; its ``tinker://`` path."""
        self.saves += 1
        name = f"prefzoo-{self.run_id}-{self.saves:04d}"
        return wait(self.training.save_state(name), self.timeout, f"save_state {name}", self.url).path


# ------------------------------------------------------------------------------------------------- the policy
class TinkerPolicy:
    """The :class:`~prefzoo.types.Policy` a plugin sees on ``backend=tinker`` (module docstring): log-probs from the
    server's forward pass as a leaf tensor whose gradient the next optimizer step sends, samples from the server's
    sampler, pi_ref from the base model's sampler.

    Args:
        session: the run's :class:`TinkerSession`; tokenizer: the base model's (pad and EOS ids);
        generator: draws the seeds of prompts without a rollout seed (the evaluation's).
    """

    tractable_logps = True
    analytic_kl = None
    value_model = None

    def __init__(self, session: TinkerSession, tokenizer, generator: torch.Generator | None = None):
        self.session = session
        self.tokenizer = tokenizer
        self.generator = generator
        self.pad_id = tokenizer.pad_token_id
        eos = tokenizer.eos_token_id
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        self.reference = session.reference
        self.device = torch.device("cpu")

    @staticmethod
    def _check_temperature(temperature: float) -> None:
        if temperature != 1.0:
            raise ConfigError(f"log-probs at temperature {temperature}: a Tinker server returns the target token's "
                              "log-prob at temperature 1 only (log-softmax at T needs the whole vocabulary); set "
                              "rollout.temperature=1.0.")

    def logps(self, batch: SequenceBatch, temperature: float = 1.0, with_entropy: bool = False
              ) -> tuple[Tensor, None]:
        """Per-token log pi_theta of the completion tokens, Shape (B, T) float32, 0 where masked. With gradients
        enabled it is a leaf with ``requires_grad`` recorded on the session's tape (its ``grad`` after the loss's
        backward is dL/dlogp, sent at the optimizer step). The entropy is None: the server returns no distribution.

        Raises:
            ConfigError: ``temperature`` other than 1."""
        self._check_temperature(temperature)
        rows, logps = self.session.forward_logps(batch)
        logps = logps.to(batch.completion_ids.device)
        if torch.is_grad_enabled():
            logps.requires_grad_(True)
            self.session.tape.append((rows, logps))
        return logps, None

    @torch.no_grad()
    def ref_logps(self, batch: SequenceBatch, temperature: float = 1.0) -> Tensor:
        """Per-token log pi_ref (the base model, from the server's base sampler), Shape (B, T) float32, no grad."""
        self._check_temperature(temperature)
        if self.reference is None:
            raise ModelError("this run has no reference: the plugin declared none.")
        return self.session.reference_logps(batch).to(batch.completion_ids.device)

    @torch.no_grad()
    def sample(self, prompts: PromptBatch, num_samples: int, params: SamplingParams) -> SequenceBatch:
        """``num_samples`` completions per prompt from the server's sampler; prompt i's seed is its
        :data:`ROLLOUT_SEED_COLUMN` value, else drawn from ``generator``."""
        seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (len(prompts.prompt_ids),), generator=self.generator).tolist()
        return self.session.sample(prompts, num_samples, params, list(seeds), self.eos_token_ids, self.pad_id)

    @contextmanager
    def seeded(self, generator: torch.Generator):
        """Inside the block the seeds of prompts without a rollout seed come from ``generator``."""
        saved, self.generator = self.generator, generator
        try:
            yield self
        finally:
            self.generator = saved


# ---------------------------------------------------------------------------------------------- the optimizer
class TinkerOptimizer(torch.optim.Optimizer):
    """The optimizer the loop steps on ``backend=tinker``: a torch optimizer over one empty placeholder tensor, so that
    the learning-rate schedule (``LambdaLR``), the checkpoint's ``optimizer`` state and the loop's ``lr`` metric work
    unchanged; ``zero_grad`` empties the session's tape, ``step`` sends it and takes the server's Adam step with this
    optimizer step's learning rate (:meth:`TinkerSession.apply`). The Adam moments live on the server."""

    def __init__(self, session: TinkerSession, lr: float, weight_decay: float, max_grad_norm: float | None):
        self.session = session
        self.grad_clip_norm = float(max_grad_norm or 0.0)
        super().__init__([torch.zeros(0, requires_grad=True)], {"lr": lr, "betas": ADAM_BETAS, "eps": ADAM_EPS,
                                                               "weight_decay": weight_decay})

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.session.tape = []

    @torch.no_grad()
    def step(self, closure=None):
        g = self.param_groups[0]
        self.session.apply(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], self.grad_clip_norm)
        return None


# ------------------------------------------------------------------------------------------ the run's weights
class RemoteWeights(torch.nn.Module):
    """What the loop holds as "the model" on ``backend=tinker``: no local parameters; saving writes the server's
    state's ``tinker://`` path (``save_state``) into the folder (:data:`CHECKPOINT_FILE`)."""

    def __init__(self, session: TinkerSession):
        super().__init__()
        self.session = session

    def save_pretrained(self, folder, **_ignored) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = self.session.save_state()
        (folder / CHECKPOINT_FILE).write_text(json.dumps(
            {"path": path, "url": self.session.url, "base_model": self.session.base_model,
             "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))


def read_checkpoint(folder: Path) -> str | None:
    """The ``tinker://`` path recorded under a checkpoint folder (its ``model/`` or ``adapter/``), or None."""
    for sub in ("model", "adapter"):
        f = Path(folder) / sub / CHECKPOINT_FILE
        if f.is_file():
            return json.loads(f.read_text())["path"]
    return None


def connect(url: str, base_model: str, rank: int, seed: int, reference: bool, tokenizer,
            resume_folder: Path | None = None, timeout: float = 600.0):
    """(session, policy, weights) of a remote run; ``resume_folder``: a checkpoint of this run to start from.

    Raises:
        ModelError: the checkpoint records no server state."""
    resume_path = None
    if resume_folder is not None:
        resume_path = read_checkpoint(resume_folder)
        if resume_path is None:
            raise ModelError(f"{resume_folder}: not a checkpoint of a backend=tinker run (no {CHECKPOINT_FILE}).")
    session = TinkerSession(url, base_model, rank, seed, reference, resume_path, timeout)
    generator = torch.Generator().manual_seed(seed)
    return session, TinkerPolicy(session, tokenizer, generator), RemoteWeights(session)
