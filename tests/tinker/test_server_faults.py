"""The server's refusals, its state on disk, sessions and two clients (issue 50, A.4), through the real SDK.

* A bad request fails as the SDK's own error type (``tinker.RequestFailedError``, category user) with a one-line
  message naming what was wrong, within seconds (never a hung future): an unknown base model, a loss the SDK knows
  but this server does not serve, a config key the loss does not have, inputs of the wrong length, a token outside the
  vocabulary, a datum longer than the model's positions, an unknown checkpoint path. The client still works afterwards.
* ``save_state`` then ``load_state_with_optimizer`` (and ``create_training_client_from_state_with_optimizer``) brings
  the adapter AND AdamW's state back bit for bit; ``load_state`` (weights only) brings the adapter back and resets the
  optimizer. The files are a real peft adapter: ``PeftModel.from_pretrained`` on the base model gives the server's
  log-probs.
* A session that stops beating (the SDK beats every 10 s) expires: its model is freed (the LoRA
  layers leave the base model) and a later request on it fails in one line.
* Two clients at once get separate models: interleaved requests (A's forward_backward, B's, A's step, B's step) leave
  A's adapter equal, bit for bit, to a client that trained alone on A's data; past ``max_models`` a new model is
  refused in one line.
"""

from __future__ import annotations

import time

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tests.tinker.conftest import start  # noqa: E402

WAIT = 30  # seconds: a future that takes longer is hung


def ce_datum(tokens: list[int], weight: float = 1.0) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [weight] * (len(tokens) - 1)})


def rl_datum(tokens: list[int], n_inputs: int | None = None) -> types.Datum:
    n = len(tokens) - 1 if n_inputs is None else n_inputs
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [-1.0] * n,
                                       "advantages": [1.0] * n})


TOKENS = [1, 504, 2682, 314, 3737, 30, 28, 31, 2]
OTHER = [1, 504, 2682, 314, 3737, 31, 28, 33, 2]
ADAM = types.AdamParams(learning_rate=1e-2, eps=1e-3)


def one_line_failure(future, *needles: str) -> str:
    start_time = time.monotonic()
    with pytest.raises(tinker.RequestFailedError) as info:
        future.result(timeout=WAIT)
    assert time.monotonic() - start_time < WAIT
    message = str(info.value)
    assert "\n" not in message and info.value.category == types.RequestErrorCategory.User
    for needle in needles:
        assert needle in message, message
    return message


def test_bad_requests_fail_in_one_line_and_the_client_goes_on(service_client):
    one_line_failure(service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4),
                     "base_model 'Qwen/Qwen3-8B' is not served here", "serves 'tiny'")
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result(timeout=WAIT)
    one_line_failure(tc.forward_backward([rl_datum(TOKENS)], "stable_reinforce"),
                     "loss_fn 'stable_reinforce' is not served here")
    one_line_failure(tc.forward_backward([rl_datum(TOKENS)], "ppo", loss_fn_config={"clip_epsilon": 0.2}),
                     "loss_fn_config key 'clip_epsilon' is not one of ppo's")
    one_line_failure(tc.forward_backward([rl_datum(TOKENS, n_inputs=3)], "importance_sampling"),
                     "datum 0: loss_fn_inputs['logprobs'] has shape (3,); expected (8,)")
    one_line_failure(tc.forward_backward([ce_datum(TOKENS[:-1] + [10 ** 7])], "cross_entropy"),
                     "datum 0: target_tokens has a token id outside [0, 49152)")
    one_line_failure(tc.forward_backward([ce_datum(TOKENS * 300)], "cross_entropy"),
                     "datum 0: 2699 tokens; the model takes at most 2048.")
    one_line_failure(tc.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                                                      loss_fn_inputs={"target_tokens": TOKENS[1:]})],
                                         "cross_entropy"),
                     "loss_fn cross_entropy needs loss_fn_inputs['weights']")
    one_line_failure(service_client.create_training_client_from_state(f"tinker://{tc.model_id}/weights/none"),
                     "no checkpoint at")
    # the client is not poisoned: a good request goes through
    out = tc.forward_backward([ce_datum(TOKENS)], "cross_entropy").result(timeout=WAIT)
    assert out.metrics["loss:sum"] > 0


def saved(server, path: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    folder = server.server.checkpoint_folder(path)[0]
    optimizer = torch.load(folder / "optimizer.pt", weights_only=True) if (folder / "optimizer.pt").exists() else None
    return load_file(str(folder / "adapter_model.safetensors")), optimizer


def same_optimizer(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_save_state_and_load_state_round_trip_adapter_and_optimizer(service_client, tinker_server, tiny_folder):
    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result(timeout=WAIT)
    for _ in range(2):
        tc.forward_backward([ce_datum(TOKENS)], "cross_entropy")
        tc.optim_step(ADAM).result(timeout=WAIT)
    path = tc.save_state("round-trip").result(timeout=WAIT).path
    adapter, optimizer = saved(tinker_server, path)
    assert len(optimizer["state"]) == len(adapter) and all(int(s["step"]) == 2 for s in optimizer["state"].values())

    tc.forward_backward([ce_datum(OTHER)], "cross_entropy")
    tc.optim_step(ADAM).result(timeout=WAIT)  # moved away from the checkpoint
    moved, _ = saved(tinker_server, tc.save_state("moved").result(timeout=WAIT).path)
    assert any(not torch.equal(moved[k], adapter[k]) for k in adapter)

    with pytest.warns(FutureWarning):  # the SDK deprecates it in favour of create_training_client_from_state*
        tc.load_state_with_optimizer(path).result(timeout=WAIT)
    back, back_optimizer = saved(tinker_server, tc.save_state("back").result(timeout=WAIT).path)
    assert all(torch.equal(back[k], adapter[k]) for k in adapter) and same_optimizer(back_optimizer, optimizer)

    fresh = service_client.create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
    again, again_optimizer = saved(tinker_server, fresh.save_state("again").result(timeout=WAIT).path)
    assert all(torch.equal(again[k], adapter[k]) for k in adapter) and same_optimizer(again_optimizer, optimizer)

    weights_only = service_client.create_training_client_from_state(path).result(timeout=WAIT)
    w, w_optimizer = saved(tinker_server, weights_only.save_state("weights-only").result(timeout=WAIT).path)
    assert all(torch.equal(w[k], adapter[k]) for k in adapter) and w_optimizer["state"] == {}

    # a real peft adapter: PeftModel.from_pretrained on the base model gives the server's log-probs
    from peft import PeftModel

    from prefzoo.models.loading import load_causal_lm
    from prefzoo.objective import token_logps

    folder = tinker_server.server.checkpoint_folder(path)[0]
    peft_model = PeftModel.from_pretrained(load_causal_lm(tiny_folder), str(folder))
    with torch.no_grad():
        local = token_logps(peft_model(input_ids=torch.tensor([TOKENS[:-1]])).logits, torch.tensor([TOKENS[1:]]))[0]
    served = fresh.forward([ce_datum(TOKENS)], "cross_entropy").result(timeout=WAIT)
    assert torch.equal(served.loss_fn_outputs[0]["logprobs"].to_torch(), local)
    listed = {c.tinker_path for c in service_client.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints}
    assert {path, f"tinker://{tc.model_id}/weights/moved"} <= listed


def test_a_silent_session_expires_and_its_model_is_freed(tiny_folder, tmp_path):
    """A client that disappears: its session is silent for longer than the timeout (60 s, as the default; the clock is
    moved on by 61 s in the call the server's reaper makes every few seconds, ``expire(now)``), so it ends: its model is
    freed (the LoRA layers leave the base model), a later request on it fails in one line, its heartbeat gets 410.
    (test_a_model_made_for_a_session_that_expired_meanwhile_is_freed: a session that expires while its model is made.)"""
    running = start(tiny_folder, tmp_path, session_timeout=60.0)
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key="tml-tests")
        tc = client.create_lora_training_client(base_model="tiny", rank=4).result(timeout=WAIT)
        server, host = running.server, running.server.host
        assert tc.model_id in host.models and host.peft is not None
        assert server.expire() == []  # alive: it was just created
        unfetched = server.submit(lambda: ("json", {}), tc.model_id)  # a result its client never fetches
        session_id = tc.model_id.split(":")[0]
        assert server.expire(now=time.monotonic() + 61) == [session_id]
        server.worker.submit(lambda: None).result()  # the free queued on the worker has run
        assert not host.models and host.peft is None, "the expired session's model was not freed"
        assert unfetched in server.futures  # kept a while: a client still there may fetch its last results
        server.expire(now=time.monotonic() + 122)  # one more timeout on: its unfetched results are forgotten too
        assert unfetched not in server.futures and session_id not in server.owners.values()
        assert not any("lora" in n for n, _ in host.base.named_parameters())
        one_line_failure(tc.forward_backward([ce_datum(TOKENS)], "cross_entropy"), "unknown model", "expired")
        import httpx

        beat = httpx.post(f"{running.url}/api/v1/session_heartbeat", json={"session_id": session_id})
        assert beat.status_code == 410 and "expired" in beat.json()["detail"]
        client.close("success").result(timeout=WAIT)  # (before the server stops: the SDK retries a finish for 5 min)
    finally:
        running.stop()


def test_two_clients_at_once_get_separate_models(tinker_server, tiny_folder, tmp_path):
    a_client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-a")
    b_client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-b")
    solo_client = tinker.ServiceClient(base_url=tinker_server.url, api_key="tml-solo")
    try:
        a = a_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(timeout=WAIT)
        b = b_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(timeout=WAIT)
        futures = [a.forward_backward([ce_datum(TOKENS)], "cross_entropy"),
                   b.forward_backward([ce_datum(OTHER, 2.0)], "cross_entropy"),
                   a.optim_step(ADAM), b.optim_step(ADAM)]
        for f in futures:
            f.result(timeout=WAIT)
        solo = solo_client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result(timeout=WAIT)
        solo.forward_backward([ce_datum(TOKENS)], "cross_entropy")
        solo.optim_step(ADAM).result(timeout=WAIT)
        a_state, _ = saved(tinker_server, a.save_state("two-a").result(timeout=WAIT).path)
        b_state, _ = saved(tinker_server, b.save_state("two-b").result(timeout=WAIT).path)
        solo_state, _ = saved(tinker_server, solo.save_state("two-solo").result(timeout=WAIT).path)
        assert all(torch.equal(a_state[k], solo_state[k]) for k in a_state)
        assert any(not torch.equal(b_state[k], solo_state[k]) for k in b_state)
    finally:
        for c in (a_client, b_client, solo_client):
            c.close("success").result()

    running = start(tiny_folder, tmp_path, max_models=1)
    try:
        first = tinker.ServiceClient(base_url=running.url, api_key="tml-first")
        second = tinker.ServiceClient(base_url=running.url, api_key="tml-second")
        first.create_lora_training_client(base_model="tiny", rank=4).result(timeout=WAIT)
        one_line_failure(second.create_lora_training_client(base_model="tiny", rank=4),
                         "this server holds 1 training models already (--max-models)")
        for c in (first, second):
            c.close("success").result(timeout=WAIT)
    finally:
        running.stop()


def test_a_model_made_for_a_session_that_expired_meanwhile_is_freed(tiny_folder, tmp_path):
    """The race, made deterministic: the session's create_model request waits on the worker (held by a job of the
    test) while the session expires (``expire`` called with a clock past the timeout: no wall-clock race, so the test
    holds at any machine load); then the worker runs the creation. The client gets a one-line error and no model is
    left behind. Before the fix: the model was registered to the ended session after it had been freed, and lived
    on (``host.models`` kept it)."""
    import threading
    import time

    running = start(tiny_folder, tmp_path, session_timeout=60.0)
    gate = threading.Event()
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key="tml-tests")
        running.server.worker.submit(gate.wait)  # the worker is busy until the session has ended
        queued = len(running.server.futures)
        pending = client.create_lora_training_client(base_model="tiny", rank=4)
        deadline = time.monotonic() + WAIT
        while len(running.server.futures) == queued and time.monotonic() < deadline:
            time.sleep(0.01)  # the create_model request is queued behind the gate
        assert len(running.server.futures) > queued
        assert running.server.expire(now=time.monotonic() + 61.0)
        gate.set()
        with pytest.raises((tinker.RequestFailedError, tinker.BadRequestError, tinker.NotFoundError)) as info:
            pending.result(timeout=WAIT)
        assert "expired" in str(info.value)
        running.server.worker.submit(lambda: None).result()  # what was queued before has run
        assert not running.server.host.models and running.server.host.peft is None
    finally:
        gate.set()
        running.stop()


def test_a_restarted_server_resumes_from_save_state_with_nothing_lost(tiny_folder, tmp_path):
    """The server dies mid-run and comes back on the same port with the same --checkpoint-dir. The client that was
    training goes on with the same ServiceClient: its old model is gone (one line: unknown model), it resumes from its
    last ``save_state`` with the optimizer, and its next step gives the adapter bit for bit as a run that never
    stopped (the reference: the same steps on the first server). Checkpoints live on disk, models in memory."""
    from prefzoo.tinker.local import make_server, start_in_thread

    first = start(tiny_folder, tmp_path)
    port = int(first.url.rsplit(":", 1)[1])
    client = tinker.ServiceClient(base_url=first.url, api_key="tml-tests")
    try:
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result(timeout=WAIT)
        for tokens in (TOKENS, OTHER):
            tc.forward_backward([ce_datum(tokens)], "cross_entropy")
            tc.optim_step(ADAM).result(timeout=WAIT)
        path = tc.save_state("before-crash").result(timeout=WAIT).path
        tc.forward_backward([ce_datum(TOKENS, 0.5)], "cross_entropy")
        tc.optim_step(ADAM).result(timeout=WAIT)
        reference, _ = saved(first, tc.save_state("never-stopped").result(timeout=WAIT).path)
    finally:
        first.stop()

    second = start_in_thread(make_server("tiny", tiny_folder, tmp_path), port=port)
    try:
        one_line_failure(tc.forward_backward([ce_datum(TOKENS)], "cross_entropy"), "unknown model")
        resumed = client.create_training_client_from_state_with_optimizer(path).result(timeout=WAIT)
        resumed.forward_backward([ce_datum(TOKENS, 0.5)], "cross_entropy")
        resumed.optim_step(ADAM).result(timeout=WAIT)
        after, _ = saved(second, resumed.save_state("resumed").result(timeout=WAIT).path)
        assert after.keys() == reference.keys() and all(torch.equal(after[k], reference[k]) for k in after)
        client.close("success").result(timeout=WAIT)
    finally:
        second.stop()


def test_a_request_longer_than_one_poll_is_waited_for_quietly(service_client, tinker_server, monkeypatch, caplog):
    """A request still running when ``retrieve_future``'s hold ends (``POLL_SECONDS``, here cut to 0.05 s while the
    worker is held 1 s): the server answers HTTP 408 with the queue state, the SDK polls again at once and the result
    arrives, with no WARNING in the client's log. Before: a 200 ``try_again`` body, which the SDK logs as a WARNING per
    poll ("Retrying request ... because of try_again"), dozens in a real-model run's train.log."""
    import logging
    import threading

    import prefzoo.tinker.server as server_module

    tc = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result(timeout=WAIT)
    monkeypatch.setattr(server_module, "POLL_SECONDS", 0.05)
    gate = threading.Event()
    tinker_server.server.worker.submit(lambda: gate.wait(1.0))
    caplog.set_level(logging.INFO, logger="tinker")
    future = tc.forward([ce_datum(TOKENS)], "cross_entropy")
    out = future.result(timeout=WAIT)
    gate.set()
    assert len(out.loss_fn_outputs) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
