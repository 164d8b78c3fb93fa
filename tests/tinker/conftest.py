"""The Tinker server of the tests (issue 50, direction A): prefzoo's own server (``prefzoo.tinker``) on the tiny model,
in a thread of the test process on a free loopback port, driven by the real ``tinker`` SDK.

``tiny_folder``: the tiny random Llama (model=tiny's default width 64, 2 layers, seed 0) and SmolLM2's tokenizer saved
once, as ``prefzoo serve --api tinker --model tiny`` saves them (the SDK loads the tokenizer from the folder the server
names). ``tinker_server``: one server for the session (its checkpoints in a temporary folder); tests that need their
own (a short session timeout, one model at most) start one with :func:`start`.
"""

from __future__ import annotations

import logging

import pytest

tinker = pytest.importorskip("tinker")

#: the SDK logs a warning on every ``try_again`` and an info line per client; the tests read their own output
logging.getLogger("tinker").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    from prefzoo.models.loading import load_causal_lm, load_tokenizer

    folder = tmp_path_factory.mktemp("tinker-models") / "models" / "tiny-h64-l2-s0"
    tokenizer = load_tokenizer("tiny")
    model = load_causal_lm("tiny", seed=0, tokenizer=tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def start(folder: str, checkpoint_dir, **kwargs):
    """A server on ``folder`` in a thread (see :func:`prefzoo.tinker.local.start_in_thread`); stop it when done."""
    from prefzoo.tinker.local import make_server, start_in_thread

    return start_in_thread(make_server("tiny", folder, checkpoint_dir, **kwargs))


@pytest.fixture(scope="session")
def tinker_server(tiny_folder, tmp_path_factory):
    running = start(tiny_folder, tmp_path_factory.mktemp("tinker-checkpoints"))
    yield running
    running.stop()


@pytest.fixture
def service_client(tinker_server):
    """A client of its own per test, closed after it (the server then frees its models)."""
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-tests")
    yield client
    client.close("success").result()
