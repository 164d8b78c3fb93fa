"""The vLLM server engine's client side (``rollout.engine=vllm_server``, issue 31 item 2) against stand-in servers.

The real servers' tests (vLLM's CPU build, ``prefzoo serve``, log-probs against the trainer's) are in
tests/rollout/test_vllm_server.py, marker ``vllm``. Here each server is a few lines of ``http.server`` that speak the
four routes the engine uses as vLLM 0.32 does (checked against a real server and vLLM's source: the same paths,
fields and status codes; a name already loaded is refused with 400, a failed load is a 500): ``GET /v1/models``, ``POST /v1/load_lora_adapter`` / ``unload_lora_adapter`` (a ``GET`` is answered 405
when the routes exist, 404 when runtime LoRA loading is off), ``POST /v1/completions``. A stand-in's completion is a
function of the prompt's ids, the seed and the sample's index only (as vLLM's seeded sampling is of the weights,
the prompt and the seed), so which server drew a prompt cannot show in its samples. What is checked: the split of a
step's prompts, token in / token out, the adapter pushed once per change under a new version, the version check,
a server dying mid-run (the rollout continues on the others; with none left, one line), and the pre-flight's checks.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from prefzoo.errors import ConfigError, ModelError
from prefzoo.rollout.vllm_server import VLLMServerEngine, check_servers, served_model_name
from prefzoo.types import ROLLOUT_SEED_COLUMN, SamplingParams
from tests.models.helpers import lora_settings, prompt_batch, tiny_model

BASE = "tiny-h64-l2-s0"
EOS = 7


class StandIn:
    """One stand-in server on a free loopback port. ``lie``: answer completions under another adapter's name;
    ``lora_routes``: whether runtime adapter loading exists; ``max_model_len``: the context it reports."""

    def __init__(self, base: str = BASE, lie: bool = False, lora_routes: bool = True, max_model_len: int = 2048,
                 max_lora_rank: int = 16):
        self.base, self.lie, self.lora_routes, self.max_model_len = base, lie, lora_routes, max_model_len
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, str] = {}
        self.prompts: list[list[int]] = []
        self.loads: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    data = [{"id": server.base, "max_model_len": server.max_model_len}]
                    data += [{"id": name, "parent": server.base} for name in server.adapters]
                    return self._send(200, {"object": "list", "data": data})
                if self.path == "/v1/load_lora_adapter" and server.lora_routes:
                    return self._send(405, {"detail": "Method Not Allowed"})
                return self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter" and server.lora_routes:
                    config = Path(body["lora_path"]) / "adapter_config.json"
                    if not config.is_file():
                        return self._send(404, {"error": {"message": f"No adapter found for {body['lora_path']}"}})
                    if body["lora_name"] in server.adapters:  # vLLM 0.32: a name already loaded is refused, 400
                        return self._send(400, {"error": {"message": f"The lora adapter '{body['lora_name']}' has "
                                                                     "already been loaded."}})
                    rank = json.loads(config.read_text())["r"]
                    if rank > server.max_lora_rank:  # vLLM 0.32: any failure to add an adapter is a 500
                        return self._send(500, {"error": {"message": f"LoRA rank {rank} is greater than max_lora_rank "
                                                                     f"{server.max_lora_rank}."}})
                    server.adapters[body["lora_name"]] = body["lora_path"]
                    server.loads.append(body["lora_name"])
                    return self._send(200, "Success")
                if self.path == "/v1/unload_lora_adapter" and server.lora_routes:
                    server.adapters.pop(body["lora_name"], None)
                    return self._send(200, "Success")
                if self.path == "/v1/completions":
                    if body["model"] not in server.adapters:
                        return self._send(404, {"error": {"message": f"The model `{body['model']}` does not exist."}})
                    server.prompts.append(list(body["prompt"]))
                    choices = []
                    for j in range(body["n"]):
                        ids = completion(body["prompt"], body["seed"], j, body["max_tokens"])
                        choices.append({"index": j, "text": "", "token_ids": ids,
                                        "logprobs": {"token_logprobs": [-0.25 * (k + 1) for k in range(len(ids))]}})
                    model = "policy-stale-v0" if server.lie else body["model"]
                    return self._send(200, {"model": model, "choices": choices[::-1]})  # (any order: index says)
                return self._send(404, {"detail": "Not Found"})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def completion(prompt: list[int], seed: int, j: int, max_tokens: int) -> list[int]:
    """The stand-in's sample j: ids from the prompt, the seed and j; it ends with EOS when (seed + j) is even."""
    ids = [10 + (sum(prompt) * 31 + seed * 7 + j * 13 + k) % 90 for k in range(max_tokens)]
    return ids[:2] + [EOS] if (seed + j) % 2 == 0 else ids


@pytest.fixture
def servers():
    made = []

    def make(**kwargs):
        made.append(StandIn(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def peft_model():
    from prefzoo.models.lora import wrap_trainable

    return wrap_trainable(tiny_model(), lora_settings(), quantized=False, adapter_path=None,
                          gradient_checkpointing=False)


def batch(n: int, seeds: list[int] | None = None):
    b = prompt_batch([[1 + i, 2, 3 + 2 * i][: 2 + i % 2] for i in range(n)])
    if seeds is not None:
        b.columns[ROLLOUT_SEED_COLUMN] = seeds
    return b


def sample(engine, model, b, n=2, tokens=5):
    return engine.sample(model, b, n, SamplingParams(temperature=1.0, max_new_tokens=tokens), eos_token_ids=[EOS],
                         pad_id=0)


def test_a_steps_prompts_are_split_over_the_servers_token_in_token_out(servers, tmp_path):
    """4 prompts over 2 servers: prompts 0-1 to the first, 2-3 to the second (contiguous shares), each sent as its
    ids without the left padding. Back: prompt i's 2 samples in rows 2i, 2i+1 as the server drew them (sample 0 of
    seed s ends with EOS when s is even: 3 tokens, EOS counted, not truncated; an odd one runs to the cap, truncated),
    right-padded with pad_id 0, with the server's log-probs (0 on padding)."""
    a, b = servers(), servers()
    engine = VLLMServerEngine([a.url, b.url], model_name=BASE, adapter_dir=tmp_path)
    out = sample(engine, peft_model(), batch(4, seeds=[10, 11, 12, 13]))
    assert sorted(a.prompts) == [[1, 2], [2, 2, 5]] and sorted(b.prompts) == [[3, 2], [4, 2, 9]]  # (in flight at once)
    want = [completion(p, s, j, 5) for p, s in zip([[1, 2], [2, 2, 5], [3, 2], [4, 2, 9]], [10, 11, 12, 13])
            for j in range(2)]
    for row, ids in enumerate(want):
        n = len(ids)
        assert out.completion_ids[row, :n].tolist() == ids and int(out.completion_mask[row].sum()) == n
        assert bool(out.truncated[row]) == (ids[-1] != EOS)
        # the stand-in's -0.25 (k + 1) are exact in JSON and float32: equal exactly (kind 1; was allclose's defaults)
        assert torch.equal(out.sample_logps[row, :n], torch.tensor([-0.25 * (k + 1) for k in range(n)]))
        assert bool((out.completion_ids[row, n:] == 0).all()) and bool((out.sample_logps[row, n:] == 0).all())
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    engine.close()


def test_the_adapter_is_pushed_once_per_change_under_a_new_version_and_the_old_one_unloaded(servers, tmp_path):
    """First rollout: version 1 loaded on both servers. A second rollout with no weight change pushes nothing. An
    in-place change of a LoRA weight (what an optimizer step does) gives version 2: loaded, then version 1 unloaded
    and its folder removed, so each server holds the current adapter only."""
    a, b = servers(), servers()
    engine = VLLMServerEngine([a.url, b.url], model_name=BASE, adapter_dir=tmp_path)
    model = peft_model()
    sample(engine, model, batch(2))
    sample(engine, model, batch(2))
    v1 = f"policy-{engine.run_id}-v1"
    assert (engine.version, engine.syncs, a.loads, b.loads) == (1, 1, [v1], [v1])
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.1)
    sample(engine, model, batch(2))
    v2 = f"policy-{engine.run_id}-v2"
    assert (engine.version, a.loads, list(a.adapters), list(b.adapters)) == (2, [v1, v2], [v2], [v2])
    assert not (tmp_path / v1).exists() and (tmp_path / v2 / "adapter_config.json").is_file()


def test_a_sample_of_another_policy_version_is_refused(servers, tmp_path):
    """A server that answers under another adapter's name (policy-stale-v0, while this run's v1 is current) would hand
    the update a rollout of another policy: one line naming the server and both versions."""
    liar = servers(lie=True)
    engine = VLLMServerEngine([liar.url], model_name=BASE, adapter_dir=tmp_path)
    with pytest.raises(ModelError, match=rf"answered with 'policy-stale-v0', not the current policy version "
                                         rf"'policy-{engine.run_id}-v1'"):
        sample(engine, peft_model(), batch(1))


def test_a_second_run_on_the_same_servers_loads_adapters_of_its_own(servers, tmp_path):
    """Two runs (or a run and its resumption) on one server: each names its adapters policy-<run id>-v<n>, so the
    second's version 1 is not the first's, which the server still holds (vLLM refuses a name it has loaded: the first
    version of this engine named them policy-v<n>, and a second run stopped at the first name the earlier run had
    left). Both sample."""
    a = servers()
    model = peft_model()
    first = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path / "one")
    second = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path / "two")
    sample(first, model, batch(1))
    sample(second, model, batch(1))
    assert first.run_id != second.run_id and len(a.loads) == 2 and len(set(a.loads)) == 2


def test_a_server_that_cannot_load_the_adapter_is_a_setting_not_a_dead_server(servers, tmp_path):
    """model.lora.r 4 against a server started with --max-lora-rank 2: vLLM answers the load with a 500, though it is
    up. One line naming the server, vLLM's reason and the fix; the server is not dropped as dead (which would have
    ended in "no other server is left", whose advice cannot help)."""
    a = servers(max_lora_rank=2)
    engine = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path)
    with pytest.raises(ModelError, match=r"failed to load the adapter \(HTTP 500: LoRA rank 4 is greater than "
                                         r"max_lora_rank 2.\); is model.lora.r above the server's --max-lora-rank"):
        sample(engine, peft_model(), batch(1))
    assert engine.live == [a.url]


def test_a_server_that_dies_mid_run_leaves_the_rollout_to_the_others(servers, tmp_path, caplog):
    """Server b stops after the first rollout: the next rollout's prompts all go to a, a warning names b, and the
    samples are those b would have drawn (seeded); b gets no more adapters. Then a stops too: one line, naming it."""
    a, b = servers(), servers()
    engine = VLLMServerEngine([a.url, b.url], model_name=BASE, adapter_dir=tmp_path, timeout=5)
    model = peft_model()
    first = sample(engine, model, batch(4, seeds=[1, 2, 3, 4]))
    b.stop()
    with caplog.at_level(logging.WARNING, logger="prefzoo.rollout.vllm_server"):
        again = sample(engine, model, batch(4, seeds=[1, 2, 3, 4]))
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert len(a.prompts) == 2 + 4 and engine.live == [a.url]
    assert any(b.url in r.getMessage() and "continue on the 1 other" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.1)
    sample(engine, model, batch(1))
    assert engine.version == 2 and b.url not in engine.live  # (version 2 went to a only)
    a.stop()
    with pytest.raises(ModelError, match=rf"the vLLM server {a.url} stopped answering .* no other server is left"):
        sample(engine, model, batch(1))


def test_a_refused_request_is_an_error_not_a_dead_server(servers, tmp_path):
    """A 4xx answer (here: an adapter folder the server cannot read) is the run's mistake, not the server's death:
    one line with the server's own message, and the server stays live."""
    a = servers()
    engine = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path)
    model = peft_model()
    engine.adapter_dir = tmp_path / "elsewhere"

    def save_nothing(folder):  # the server is told a folder that holds no adapter
        Path(folder).mkdir(parents=True, exist_ok=True)

    model.save_pretrained = save_nothing
    with pytest.raises(ModelError, match=r"refused /v1/load_lora_adapter \(HTTP 404\): No adapter found"):
        sample(engine, model, batch(1))
    assert engine.live == [a.url]


def test_the_preflight_checks_each_server(servers):
    """What a run checks before any model loads: the server answers vLLM's model list, serves the run's base model
    under its served name, has room for the run's tokens, and has the runtime adapter routes."""
    good = servers()
    assert check_servers([good.url], BASE, 512)[0]["id"] == BASE
    other = servers(base="smollm2")
    with pytest.raises(ConfigError, match=r"rollout.servers\[1\]=.* serves smollm2, not the run's base model "
                                          r"'tiny-h64-l2-s0'"):
        check_servers([good.url, other.url], BASE, 512)
    short = servers(max_model_len=128)
    with pytest.raises(ConfigError, match=r"a context of 128 tokens, shorter than .* = 512; restart it with "
                                          r"--max-model-len 512"):
        check_servers([short.url], BASE, 512)
    no_lora = servers(lora_routes=False)
    with pytest.raises(ConfigError, match=r"cannot load LoRA adapters at run time"):
        check_servers([no_lora.url], BASE, 512)
    gone = servers()
    gone.stop()
    with pytest.raises(ConfigError, match=r"rollout.servers\[0\]=.*: no vLLM server answers there"):
        check_servers([gone.url], BASE, 512)
    with pytest.raises(ConfigError, match=r"needs rollout.servers"):
        check_servers([], BASE, 512)


def test_served_names():
    """The tiny model's weights depend on its size and seed, so its served name carries them; others keep theirs."""
    assert served_model_name("tiny", tiny_hidden_size=128, tiny_layers=2, seed=3) == "tiny-h128-l2-s3"
    assert served_model_name("smollm2") == "smollm2"
    assert served_model_name("/models/llama", seed=5) == "/models/llama"


def test_another_data_parallel_process_waits_for_the_main_ones_adapter(servers, tmp_path):
    """Two data-parallel processes on one server (two engines here, the same weights): the other process's rollout
    starts first and waits until the main process has pushed version 1 (it lists in /v1/models), then samples with it;
    the server loaded the adapter once, from the main process. A second process that waits past its limit stops with
    one line."""
    a = servers()
    main = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path, is_main=True)
    other = VLLMServerEngine([a.url], model_name=BASE, adapter_dir=tmp_path / "unused", is_main=False)
    other.run_id = main.run_id  # (under torch.distributed the main process's id is broadcast)
    model = peft_model()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out", sample(other, model, batch(2, seeds=[1, 2]))))
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive() and a.loads == []  # waiting: nothing pushed yet
    mine = sample(main, model, batch(2, seeds=[1, 2]))
    thread.join(timeout=30)
    assert not thread.is_alive() and a.loads == [main.adapter_name] and other.version == main.version == 1
    assert torch.equal(result["out"].completion_ids, mine.completion_ids)
    late = VLLMServerEngine([a.url], model_name=BASE, is_main=False, wait_seconds=0.5)
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.1)
    late.version, late._stamp, late.run_id = 1, main._stamp, main.run_id  # it saw version 1; the weights changed since
    with pytest.raises(ModelError, match=rf"did not get adapter policy-{main.run_id}-v2 from the main process within 0 s"):
        sample(late, model, batch(1))
