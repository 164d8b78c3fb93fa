"""``prefzoo serve --api tinker``: a local server of the Tinker training API, which the unmodified ``tinker`` SDK
(0.38.0) talks to: ``tinker.ServiceClient(base_url="http://127.0.0.1:PORT", api_key="tml-anything")``.

A FastAPI app (served by uvicorn) over one :class:`prefzoo.tinker.host.ModelHost`. The SDK's flow, and what answers it:

* ``client/config``: the flags this server chooses: no JWT exchange (any API key), plain httpx transport (no pyqwest),
  fwd/bwd chunks sent one after another (so requests reach the server in the client's order), no zstd (a zstd body
  is still accepted), custom losses on the client; ``client/dynamic_config``, ``telemetry``, ``healthz``;
* sessions: ``create_session`` and ``session_heartbeat`` (the SDK beats every 10 s; a session id this server never
  saw, from a client that outlived a restart of the server, is adopted: its checkpoints are on disk); a session silent for
  ``session_timeout`` seconds expires and its models are freed (adapters, gradients, optimizer state, samplers), as is
  a session the client finishes (``sessions/{id}/finish``). A later request of an expired session's model fails with
  one line; its heartbeat gets 410, which stops the SDK's heartbeat loop;
* ``get_server_capabilities``: the one model served; ``create_model`` (a LoRA training client) and ``get_info``;
* work: ``forward_backward`` (protobuf, ``forward_only`` for ``forward``), ``optim_step``, ``save_weights`` /
  ``load_weights`` (``save_state`` / ``load_state`` and create-from-state, with and without the optimizer),
  ``save_weights_for_sampler`` (a named sampler checkpoint, or a sampling session on a snapshot), ``asample``: each is
  queued on ONE worker thread and answered at once with a future (``request_id``); ``retrieve_future`` waits up to
  :data:`POLL_SECONDS` for it, then answers ``try_again``. A failed request comes back as the SDK's
  ``RequestFailedError`` with a one-line message (``category`` user for a bad request, server otherwise), never a hung
  future. Results are kept until fetched, or until ``session_timeout`` after their session ended;
* checkpoints: under ``--checkpoint-dir``, ``RUN/weights/NAME`` (adapter + optimizer) and ``RUN/sampler_weights/NAME``
  (adapter), addressed as ``tinker://RUN/weights/NAME``; ``training_runs/RUN/checkpoints`` lists them and
  ``weights_info`` describes one.

Two clients at once are served with separate models (their own adapters and optimizers over the shared frozen base
model, one request at a time on the worker), up to ``--max-models``; more is refused in one line.
"""

# no ``from __future__ import annotations`` here: FastAPI reads the routes' annotations (``Request``, imported
# inside build_app) at definition time
import asyncio
import concurrent.futures
import itertools
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from prefzoo.errors import PrefzooError
from prefzoo.tinker.host import HostError, LoraShape, ModelHost

__all__ = ["TinkerServer", "build_app", "POLL_SECONDS"]

#: how long ``retrieve_future`` holds a request open for its result before answering ``try_again``
POLL_SECONDS = 20.0
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


@dataclass
class Session:
    session_id: str
    last_seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    ended: str | None = None  # why it ended (expired / finished), None while alive
    ended_at: float | None = None  # when (time.monotonic())


@dataclass
class Sampler:
    sampler_id: str
    session_id: str
    model_path: str | None
    shape: LoraShape | None
    snapshot: dict[str, torch.Tensor] | None  # None: the base model


@dataclass
class PendingSample:
    """One ``asample`` request waiting on the worker: what it asks, the batch key it shares with others, its result."""

    key: tuple  # (id(snapshot), shape, num_samples, max_tokens, temperature, top_p, top_k, stop, seeded, prompt lps)
    sampler: "Sampler"
    prompt: list[int]
    seed: int | None
    result: Any = None
    error: BaseException | None = None


#: how long the worker waits, when it starts a batch of sampling requests, for the rest of a burst to arrive (a client
#: such as the cookbook's sends one request per prompt at once; they reach the server a few milliseconds apart)
SAMPLE_GATHER_SECONDS = 0.05


class TinkerServer:
    """The state behind the app: sessions, samplers, futures and the worker (see the module docstring).

    Args:
        host: the models; checkpoint_dir: where checkpoints are written; session_timeout: seconds without a
        heartbeat after which a session expires; max_context_length: reported in the capabilities.
    """

    def __init__(self, host: ModelHost, checkpoint_dir: Path, *, session_timeout: float = 60.0,
                 max_context_length: int = 2048):
        self.host = host
        self.checkpoint_dir = Path(checkpoint_dir)
        self.session_timeout = session_timeout
        self.max_context_length = max_context_length
        self.sessions: dict[str, Session] = {}
        self.samplers: dict[str, Sampler] = {}
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.owners: dict[str, str] = {}  # request id -> the session that made it
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-worker")
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self.pending_samples: list[PendingSample] = []

    def sample_batched(self, entry: PendingSample, prompt_logprobs: bool) -> Any:
        """``entry``'s samples, run on the worker. Requests that wait with the same settings (the same sampler
        weights, num_samples, max_tokens, temperature, top-p, top-k, stop, seeded or not, prompt log-probs or not;
        ``compute_logprobs`` is a request with prompt log-probs) are sampled in ONE batch with it (:meth:`ModelHost.sample_many`); their own jobs then find their result ready."""
        if entry.result is None and entry.error is None:
            time.sleep(SAMPLE_GATHER_SECONDS)
            with self.lock:
                group = [e for e in self.pending_samples if e.key == entry.key]
                for e in group:
                    if e in self.pending_samples:
                        self.pending_samples.remove(e)
            (_, _, n, max_tokens, temperature, top_p, top_k, stop, _, _) = entry.key
            try:
                results = self.host.sample_many(entry.sampler.shape, entry.sampler.snapshot, [e.prompt for e in group],
                                                n, max_tokens, temperature, top_p, top_k,
                                                list(stop) if stop is not None else None, [e.seed for e in group],
                                                prompt_logprobs)
                for e, r in zip(group, results):
                    e.result = r
            except BaseException as err:  # noqa: BLE001 - every request of the batch fails with it, none hangs
                for e in group:
                    e.error = err
        if entry.error is not None:
            raise entry.error
        return entry.result

    # --- bookkeeping ------------------------------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        """The live session ``session_id``. One this server has never seen (it restarted under a running client) is
        adopted as new, so the client goes on (its models are gone; its checkpoints are on disk); HostError for one
        that ended here."""
        with self.lock:
            session = self.sessions.get(session_id)
            if session is None:
                session = self.sessions[session_id] = Session(session_id, time.monotonic())
        if session.ended:
            raise HostError(f"session {session_id} has {session.ended}; create a new ServiceClient.")
        return session

    def owner(self, model_id: str) -> Session | None:
        with self.lock:
            return next((s for s in self.sessions.values() if model_id in s.models), None)

    def submit(self, job: Callable[[], tuple[str, Any]], owner: str) -> str:
        """Queue ``job`` on the worker for session ``owner`` (a model id's or sampler id's first part); its request
        id."""
        request_id = str(next(self._ids))
        self.futures[request_id] = self.worker.submit(job)
        self.owners[request_id] = owner.split(":", 1)[0]
        return request_id

    def drop_results(self, now: float) -> None:
        """Forget the unfetched results of sessions that ended more than ``session_timeout`` ago (their clients are
        gone; a client still there has had that long to fetch them, its last failures included)."""
        with self.lock:
            gone = {s.session_id for s in self.sessions.values()
                    if s.ended and s.ended_at is not None and now - s.ended_at > self.session_timeout}
        for request_id in [r for r, owner in list(self.owners.items()) if owner in gone]:
            future = self.futures.get(request_id)
            if future is None or future.done():
                self.futures.pop(request_id, None)
                self.owners.pop(request_id, None)

    def end_session(self, session: Session, why: str) -> None:
        """Mark ``session`` ended and free its models and samplers (on the worker, after its queued work)."""
        with self.lock:
            if session.ended:
                return
            session.ended, session.ended_at = why, time.monotonic()
            models, samplers = list(session.models), list(session.samplers)
            for sampler_id in samplers:
                self.samplers.pop(sampler_id, None)

        def free():
            for model_id in models:
                self.host.free(model_id)
            return "json", {}

        self.worker.submit(free)

    def expire(self, now: float | None = None) -> list[str]:
        """End every session silent for longer than ``session_timeout`` (and forget the results of sessions long
        ended); the ids of the sessions ended now."""
        now = time.monotonic() if now is None else now
        with self.lock:
            stale = [s for s in self.sessions.values() if not s.ended and now - s.last_seen > self.session_timeout]
        for session in stale:
            self.end_session(session, f"expired ({self.session_timeout:g} s without a heartbeat)")
        self.drop_results(now)
        return [s.session_id for s in stale]

    # --- checkpoints ------------------------------------------------------------------------------------------------

    def checkpoint_folder(self, path: str) -> tuple[Path, str, str, str]:
        """(folder, run id, kind, name) of a ``tinker://RUN/weights|sampler_weights/NAME`` path; HostError if it is
        not one."""
        kinds = {"weights": "training", "sampler_weights": "sampler"}
        parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in kinds or not _NAME.match(parts[2]) or not parts[0] or "." in parts[0]:
            raise HostError(f"{path!r} is not a checkpoint path; expected tinker://RUN/weights/NAME or "
                            "tinker://RUN/sampler_weights/NAME (as save_state / save_weights_for_sampler return).")
        return self.checkpoint_dir / parts[0] / parts[1] / parts[2], parts[0], parts[1], parts[2]

    def new_checkpoint(self, model_id: str, kind: str, name: str | None) -> tuple[Path, str]:
        if name is None:
            name = f"{kind}-{int(time.time() * 1000)}"
        if not _NAME.match(name):
            raise HostError(f"checkpoint name {name!r}: use letters, digits, '_', '-' and '.' (no '/').")
        path = f"tinker://{model_id}/{kind}/{name}"
        return self.checkpoint_dir / model_id / kind / name, path

    def list_checkpoints(self, run_id: str) -> list[dict]:
        out = []
        for kind, ctype in (("weights", "training"), ("sampler_weights", "sampler")):
            folder = self.checkpoint_dir / run_id / kind
            if not folder.is_dir():
                continue
            for ckpt in sorted(folder.iterdir()):
                size = sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())
                stamp = datetime.fromtimestamp(ckpt.stat().st_mtime, tz=timezone.utc).isoformat()
                out.append({"checkpoint_id": f"{kind}/{ckpt.name}", "checkpoint_type": ctype, "time": stamp,
                            "tinker_path": f"tinker://{run_id}/{kind}/{ckpt.name}", "size_bytes": size})
        return out


def _one_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return text or type(err).__name__


def _failure(err: BaseException) -> dict:
    """A failed request as the SDK reads it: RequestFailedError with this message and category."""
    if isinstance(err, PrefzooError):
        return {"error": _one_line(err), "category": "user"}
    return {"error": f"{type(err).__name__}: {_one_line(err)}", "category": "server"}


def build_app(server: TinkerServer):
    """The FastAPI app of ``server`` (the routes the SDK calls; see the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from tinker import types

    from prefzoo.tinker import wire
    from prefzoo.tinker.losses import LOSSES, loss_config

    host = server.host

    async def reaper():
        while True:
            await asyncio.sleep(max(min(server.session_timeout / 4, 5.0), 0.05))
            server.expire()

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="prefzoo Tinker server", lifespan=lifespan)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status)

    async def parse(request: Request, model):
        try:
            return model.model_validate(await request.json())
        except Exception as err:  # pydantic.ValidationError, JSON errors
            raise _BadRequest(f"not a {model.__name__}: {_one_line(err)}") from None

    class _BadRequest(Exception):
        pass

    @app.exception_handler(_BadRequest)
    async def bad_request(request, exc):
        return error(400, str(exc))

    @app.exception_handler(HostError)
    async def host_error(request, exc):
        return error(404 if "unknown" in str(exc) else 400, _one_line(exc))

    # --- the client's setup -----------------------------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config():
        return types.ClientConfigResponse(pjwt_auth_enabled=False, use_pyqwest_transport=False,
                                          parallel_fwdbwd_chunks=False, proto_compress_fwdbwd=False,
                                          custom_loss_server_side=False, sample_use_retrieve_futures=False,
                                          sample_join_sampling_session=False).model_dump()

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return types.ClientDynamicConfigResponse().model_dump()

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": host.name, "max_context_length": server.max_context_length,
                                      "trainable": True, "sampleable": True}]}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        await parse(request, types.CreateSessionRequest)
        session_id = uuid.uuid4().hex[:16]
        with server.lock:
            server.sessions[session_id] = Session(session_id, time.monotonic())
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await request.json()
        session_id = str(body.get("session_id"))
        with server.lock:
            session = server.sessions.get(session_id)
            if session is None:  # a client of this server before it restarted: adopted (see TinkerServer.session)
                session = server.sessions[session_id] = Session(session_id, time.monotonic())
            if not session.ended:
                session.last_seen = time.monotonic()
        if session.ended:
            return error(410, f"session {session_id!r} has {session.ended}")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        with server.lock:
            session = server.sessions.get(session_id)
        if session is not None:
            server.end_session(session, "finished (the client closed it)")
        return Response(status_code=200)

    # --- models -----------------------------------------------------------------------------------------------------

    def info(model_id: str) -> dict:
        model = host.get(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": model.shape.rank,
                "model_name": host.folder,
                "model_data": {"arch": type(host.base).__name__, "model_name": host.folder,
                               "tokenizer_id": host.folder}}

    def register(session: Session, model_id: str) -> None:
        """(On the worker, once the model exists.) Count it as the session's, or, if the session ended meanwhile (it
        expired while the model was being made), free it at once: no model outlives its session."""
        with server.lock:
            if not session.ended:
                session.models.add(model_id)
                return
        host.free(model_id)
        raise HostError(f"session {session.session_id} has {session.ended}; create a new ServiceClient.")

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = await parse(request, types.CreateModelRequest)
        session = server.session(req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        lora = req.lora_config or types.LoraConfig(rank=32)
        shape = LoraShape(lora.rank, lora.train_attn, lora.train_mlp, lora.train_unembed)
        if req.optimizer_config.type != "adamw":
            raise HostError(f"optimizer {req.optimizer_config.type!r} is not served here; this server trains with "
                            "AdamW (types.AdamOptimizerConfig).")

        def job():
            host.create(model_id, req.base_model, shape, lora.seed)
            register(session, model_id)
            return "json", {"type": "create_model", "model_id": model_id}

        return {"request_id": server.submit(job, model_id), "model_id": model_id}

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await request.json()
        return info(str(body.get("model_id")))

    def live_model(model_id: str) -> None:
        """HostError when the model's session has ended (its model is freed, or being freed)."""
        session = server.owner(model_id)
        if session is not None and session.ended:
            raise HostError(f"unknown model {model_id!r}: its session {session.ended}.")

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        try:
            req = wire.decode_forward_backward(await request.body(), request.headers.get("content-encoding"))
        except wire.WireError as err:
            raise _BadRequest(_one_line(err)) from None
        model_id = req["model_id"]

        def job():
            live_model(model_id)
            config = loss_config(req["loss_fn"], req["loss_fn_config"])
            logprobs, metrics = host.forward_backward(model_id, req["data"], req["loss_fn"], config,
                                                      req["forward_only"])
            return "proto", wire.encode_forward_backward_output(logprobs, metrics)

        return {"request_id": server.submit(job, model_id), "model_id": model_id}

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await request.json()
        model_id = str(body.get("model_id"))
        params = body.get("adam_params")

        def job():
            live_model(model_id)
            if params is None:
                raise HostError("optim_step: this server takes AdamParams only (adam_params).")
            adam = types.AdamParams.model_validate(params)
            metrics = host.optim_step(model_id, adam.learning_rate, adam.beta1, adam.beta2, adam.eps,
                                      adam.weight_decay, adam.grad_clip_norm)
            return "json", {"metrics": metrics}

        return {"request_id": server.submit(job, model_id), "model_id": model_id}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        req = await parse(request, types.SaveWeightsRequest)

        def job():
            live_model(req.model_id)
            host.get(req.model_id)
            folder, path = server.new_checkpoint(req.model_id, "weights", req.path)
            if folder.exists() and not req.overwrite:
                raise HostError(f"checkpoint {path} exists; pass overwrite=True or another name.")
            host.save(req.model_id, folder, optimizer=True)
            return "json", {"type": "save_weights", "path": path}

        return {"request_id": server.submit(job, req.model_id), "model_id": req.model_id}

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        req = await parse(request, types.LoadWeightsRequest)
        folder, _, _, _ = server.checkpoint_folder(req.path)
        if req.session_id is not None:  # create-from-state: a new model shaped like the checkpoint
            session = server.session(req.session_id)
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
        else:
            session, model_id = None, str(req.model_id)

        def job():
            if session is not None:
                shape = ModelHost.read_shape(folder)
                host.create(model_id, req.base_model or host.name, shape, seed=None)
                register(session, model_id)
            live_model(model_id)
            host.load(model_id, folder, optimizer=req.optimizer)
            return "json", {"type": "load_weights", "path": req.path, "model_id": model_id}

        return {"request_id": server.submit(job, model_id), "model_id": model_id}

    def new_sampler(session_id: str, model_path: str | None, shape, snapshot) -> str:
        sampler_id = f"{session_id}:sample:{uuid.uuid4().hex[:8]}"
        with server.lock:
            server.samplers[sampler_id] = Sampler(sampler_id, session_id, model_path, shape, snapshot)
            if session_id in server.sessions:
                server.sessions[session_id].samplers.add(sampler_id)
        return sampler_id

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        req = await parse(request, types.SaveWeightsForSamplerRequest)

        def job():
            live_model(req.model_id)
            model = host.get(req.model_id)
            if req.path is not None:
                folder, path = server.new_checkpoint(req.model_id, "sampler_weights", req.path)
                host.save(req.model_id, folder, optimizer=False)
                return "json", {"type": "save_weights_for_sampler", "path": path}
            session_id = req.model_id.split(":", 1)[0]
            sampler_id = new_sampler(session_id, None, model.shape, host.adapter_state(req.model_id))
            return "json", {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

        return {"request_id": server.submit(job, req.model_id), "model_id": req.model_id}

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        from safetensors.torch import load_file

        req = await parse(request, types.CreateSamplingSessionRequest)
        server.session(req.session_id)
        if req.model_path is not None:
            folder, _, _, _ = server.checkpoint_folder(req.model_path)
            shape = ModelHost.read_shape(folder)
            snapshot = load_file(str(folder / "adapter_model.safetensors"))
        else:
            host.resolve(req.base_model or "")
            shape, snapshot = None, None
        return {"type": "create_sampling_session",
                "sampling_session_id": new_sampler(req.session_id, req.model_path, shape, snapshot)}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        sampler = server.samplers.get(sampler_id)
        if sampler is None:
            raise HostError(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": host.folder, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        req = await parse(request, types.SampleRequest)
        sampler = server.samplers.get(req.sampling_session_id or "")
        if sampler is None:
            if req.base_model is None and req.model_path is None:
                raise HostError(f"unknown sampling session {req.sampling_session_id!r} (or its session ended).")
            host.resolve(req.base_model or host.name)
            sampler = Sampler("", "", req.model_path, None, None)
        if any(not isinstance(c, types.EncodedTextChunk) for c in req.prompt.chunks):
            raise _BadRequest("the prompt has a non-token chunk; this server takes token chunks only.")
        if req.topk_prompt_logprobs or req.topk_sample_logprobs or req.prompt_alt_tokens_k or \
                req.target_prompt_logprobs is not None:
            raise _BadRequest("top-k log-probs, target prompt log-probs and prompt alternatives are not served here.")
        prompt = req.prompt.to_ints()
        sp = req.sampling_params
        stop = sp.stop
        if isinstance(stop, str):
            stop = [stop]
        elif stop is not None:
            stop = list(stop)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else 64
        ids = [f"{req.sampling_session_id}:{req.seq_id}:{i}" for i in range(req.num_samples)]

        host.check_sample(prompt, req.num_samples, max_tokens)
        entry = PendingSample((id(sampler.snapshot), sampler.shape, req.num_samples, max_tokens, sp.temperature,
                               sp.top_p, sp.top_k, tuple(stop) if stop is not None else None, sp.seed is not None,
                               bool(req.prompt_logprobs)),
                              sampler, prompt, sp.seed)
        with server.lock:
            server.pending_samples.append(entry)

        def job():
            result = server.sample_batched(entry, bool(req.prompt_logprobs))
            if req.prompt_logprobs_last_n is not None and result.prompt_logprobs is not None:
                keep = req.prompt_logprobs_last_n
                result.prompt_logprobs = [math.nan] * (len(prompt) - keep) + result.prompt_logprobs[-keep:]
            return "proto", wire.encode_sample_response(result.tokens, result.logprobs, result.stop_reasons,
                                                        result.prompt_logprobs)

        return {"request_id": server.submit(job, sampler.session_id), "sample_sequence_ids": ids}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await request.json()
        request_id = str(body.get("request_id"))
        future = server.futures.get(request_id)
        if future is None:
            # 410: the SDK's "promise expired" (a restarted server knows none of the earlier requests)
            return error(410, f"unknown request {request_id!r} (never made here, its result was fetched, or the server "
                              "restarted)")
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=POLL_SECONDS)
        except asyncio.TimeoutError:
            # still running: HTTP 408 with the queue state, the SDK's quiet "poll again" (it retries at once and logs
            # nothing; a 200 ``try_again`` body would log a WARNING per poll). ``x-should-retry: false`` keeps the
            # HTTP layer's own retries (with their backoff) out of it: the future's poll loop retries
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"},
                                status_code=408, headers={"x-should-retry": "false"})
        except Exception:  # the job's own failure, read below
            pass
        server.futures.pop(request_id, None)
        server.owners.pop(request_id, None)
        err = future.exception()
        if err is not None:
            return _failure(err)
        kind, payload = future.result()
        if kind == "proto":
            return Response(content=payload, media_type="application/x-protobuf")
        return payload

    # --- checkpoints ------------------------------------------------------------------------------------------------

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(run_id: str):
        return {"checkpoints": server.list_checkpoints(run_id)}

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        body = await request.json()
        folder, _, _, _ = server.checkpoint_folder(str(body.get("tinker_path")))
        shape = ModelHost.read_shape(folder)
        return {"base_model": host.name, "is_lora": True, "lora_rank": shape.rank,
                "train_unembed": shape.train_unembed, "train_mlp": shape.train_mlp, "train_attn": shape.train_attn}

    app.state.tinker = server
    app.state.losses = tuple(LOSSES)
    return app
