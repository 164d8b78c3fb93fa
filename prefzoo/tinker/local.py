"""Build a Tinker server on a model folder and run it: in the foreground (``prefzoo serve --api tinker``) or in a
thread of this process (tests, notebooks: :func:`start_in_thread`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["make_server", "start_in_thread", "RunningServer", "serve_forever"]


def make_server(name: str, folder: str, checkpoint_dir: str | Path, *, seed: int = 0, max_models: int = 4,
                session_timeout: float = 60.0, max_context_length: int = 2048):
    """A :class:`prefzoo.tinker.server.TinkerServer` on the model in ``folder`` (served as ``name``; the folder's
    path is accepted too)."""
    from prefzoo.models.loading import load_causal_lm, load_tokenizer
    from prefzoo.tinker.host import ModelHost
    from prefzoo.tinker.server import TinkerServer

    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder)
    host = ModelHost(name, folder, model, tokenizer, aliases=(folder,), max_models=max_models, seed=seed)
    return TinkerServer(host, Path(checkpoint_dir), session_timeout=session_timeout,
                        max_context_length=min(max_context_length, host.max_length))


@dataclass
class RunningServer:
    """A server running in a thread: its base URL; ``stop()`` ends it."""

    url: str
    server: object  # TinkerServer
    _uvicorn: object
    _thread: threading.Thread

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        self.server.worker.shutdown(wait=False, cancel_futures=True)


def start_in_thread(server, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve ``server`` with uvicorn in a daemon thread on ``host:port`` (0: a free port); returns once it listens."""
    import uvicorn

    from prefzoo.tinker.server import build_app

    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning", lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, name="tinker-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the Tinker server did not start")
        time.sleep(0.01)
    bound = uv.servers[0].sockets[0].getsockname()[1]
    return RunningServer(f"http://{host}:{bound}", server, uv, thread)


def serve_forever(server, host: str, port: int) -> None:
    """Serve ``server`` in the foreground until interrupted."""
    import uvicorn

    from prefzoo.tinker.server import build_app

    uvicorn.run(build_app(server), host=host, port=port, log_level="info")
