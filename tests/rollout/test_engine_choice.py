"""Choosing the rollout engine (issue 18): ``rollout.engine=hf|vllm`` is checked before any model loads.

These run in the normal venv, where vLLM is not installed (the engine's own tests are in
tests/rollout/test_vllm_engine.py, marker ``vllm``, run by ``make test-vllm`` in .venv-vllm).
"""

import importlib.util

import pytest

from prefzoo import cli
from prefzoo.models import loading
from prefzoo.training import loop
from tests.test_config import composed

NO_VLLM = importlib.util.find_spec("vllm") is None


def _run_until_error(monkeypatch, capsys, *overrides) -> str:
    """``cli.run_from_hydra`` on the composed config with the model and tokenizer loaders and the Trainer replaced by
    tripwires: the one-line stderr of the exit-2 error that stopped it before any of them ran."""
    def tripwire(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded / the trainer was built before the engine was checked")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(loop, "load_tokenizer", tripwire)
    monkeypatch.setattr(loop, "Trainer", tripwire)
    with pytest.raises(SystemExit) as exit_:
        cli.run_from_hydra(composed("model=tiny", "algo=grpo", *overrides))
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here: the install hint cannot show")
def test_vllm_engine_without_vllm_fails_before_any_model_loads_with_the_install_command(monkeypatch, capsys):
    """Without vLLM, rollout.engine=vllm stops at the configuration with one line that gives the pip command.
    Before the check existed: Hydra rejected the unknown key rollout.engine (no install command)."""
    err = _run_until_error(monkeypatch, capsys, "rollout.engine=vllm")
    assert err.startswith("prefzoo: error: rollout.engine=vllm needs vLLM, which is not installed")
    assert "pip install 'prefzoo[vllm]'" in err and "pip install vllm" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.engine=sglang"], "rollout.engine='sglang' is not valid; choose one of: hf, vllm, vllm_server"),
    (["rollout.engine=vllm_server"], "rollout.engine=vllm_server needs rollout.servers=[http://host:port, ...]"),
    (["rollout.engine=vllm_server", "rollout.servers=[localhost:8000]"],
     "rollout.servers[0]='localhost:8000' is not a server address; give http://host:port"),
    (["rollout.servers=[http://127.0.0.1:8000]"], "rollout.servers is set but rollout.engine=hf samples without them"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]", "model.lora.enabled=false"],
     "rollout.engine=vllm_server sends the trained weights to the engine as a LoRA adapter"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:99999]"],
     "rollout.servers[0]='http://127.0.0.1:99999' is not a server address"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:abc]"],
     "rollout.servers[0]='http://127.0.0.1:abc' is not a server address"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:8000/v1]"],
     "give the server's address without a path (not .../v1"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:8000,http://127.0.0.1:8000/]"],
     "rollout.servers[1]='http://127.0.0.1:8000/' is rollout.servers[0] again"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]", "rollout.vllm.dtype=bfloat16"],
     "rollout.vllm.dtype=bfloat16 sets the in-process engine; with rollout.engine=vllm_server the servers decide it: "
     "start them with `prefzoo serve --dtype ...`"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]", "rollout.dtype=bfloat16"],
     "start them with `prefzoo serve --dtype bfloat16`"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]", "rollout.vllm.request_timeout=0"],
     "rollout.vllm.request_timeout=0.0: seconds one completion request may take"),
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]", "rollout.vllm.adapter_dir=/proc/nope"],
     "rollout.vllm.adapter_dir='/proc/nope' is not a folder this process can write"),
    # a closed port (9, discard, nothing listens): one line before any model loads, with or without vLLM here
    (["rollout.engine=vllm_server", "rollout.servers=[http://127.0.0.1:9]"],
     "rollout.servers[0]=http://127.0.0.1:9: no vLLM server answers there (ConnectError"),
    (["rollout.correction.mode=token_truncate"], "rollout.engine=hf samples with the trainer's own model"),
    (["rollout.correction.bypass=true"], "rollout.engine=hf samples with the trainer's own model"),
    (["rollout.engine=vllm", "rollout.correction.mode=token_truncate", "rollout.correction.clip_max=0"],
     "rollout.correction.clip_max=0.0 is invalid"),
    (["rollout.engine=vllm", "rollout.correction.mode=token"], "rollout.correction.mode='token' is not valid"),
    (["rollout.engine=vllm", "rollout.correction.mode=token_truncate", "rollout.correction.clip_min=2",
      "rollout.correction.clip_max=1"], "the band [clip_min, clip_max] is empty"),
    (["rollout.engine=vllm", "rollout.correction.mode=token_mask", "rollout.correction.bypass=true"],
     "the weight pi_old / pi_sampler is 1"),
    (["rollout.top_k=-1"], "rollout.top_k=-1: a number of tokens >= 0"),
    (["rollout.log_mismatch=true", "rollout.correction.mode=token_mask", "rollout.correction.bypass=false",
      "algo=online_dpo"], "algo=online_dpo does not weight its loss by the sampler correction"),
    (["rollout.log_mismatch=true", "rollout.correction.bypass=true", "rollout.top_p=0.9"],
     "the sampler's log-probs are renormalised over the tokens it kept"),
])
def test_bad_engine_settings_fail_before_any_model_loads(monkeypatch, capsys, overrides, needle):
    """The engine's name and the correction cap are checked with the rest of the config (the cap's check comes
    before the install check, so it shows with or without vLLM)."""
    err = _run_until_error(monkeypatch, capsys, *overrides)
    assert err.startswith("prefzoo: error: ") and needle in err and err.count("\n") == 1


def test_hf_stays_the_default_engine():
    """No override: the typed config's engine is hf, no correction (today's behaviour)."""
    from prefzoo.cli import to_typed

    typed = to_typed(composed("model=tiny", "algo=grpo"))
    assert typed.rollout.engine == "hf" and typed.rollout.correction.mode is None
    assert not typed.rollout.correction.bypass


def test_vllm_chat_template_warmup_warning_is_dropped_even_after_vllm_reconfigures_its_loggers(caplog):
    """vLLM's engine start logs "Chat template warmup failed" plus a traceback (its warmup needs the tokenizer the
    engine skips): seen in every rollout.engine=vllm run's log. First fix (a logger level around vllm.LLM()) did not
    hold: vLLM's dictConfig resets the levels of the child loggers of "vllm" (the traceback was still printed). The
    filter survives the same dictConfig; other warnings of that logger still pass."""
    import logging.config

    from prefzoo.rollout.vllm_engine import _quiet_chat_template_warmup

    _quiet_chat_template_warmup()
    _quiet_chat_template_warmup()  # idempotent
    renderer = logging.getLogger("vllm.renderers.base")
    assert len(renderer.filters) == 1
    parent = logging.getLogger("vllm")
    saved = (parent.level, list(parent.handlers), parent.propagate)
    try:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                                   "loggers": {"vllm": {"level": "DEBUG"}}})  # what vLLM's set-up does to its children
        with caplog.at_level(logging.WARNING, logger="vllm.renderers.base"):
            renderer.warning("Chat template warmup failed", exc_info=False)
            renderer.warning("Using None for EOS token id because tokenizer is not initialized")
    finally:  # leave logging as it was for the rest of the session
        parent.setLevel(saved[0])
        parent.handlers[:] = saved[1]
        parent.propagate = saved[2]
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.renderers.base"]
    assert messages == ["Using None for EOS token id because tokenizer is not initialized"]
