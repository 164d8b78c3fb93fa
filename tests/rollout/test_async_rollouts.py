"""Asynchronous rollouts with bounded staleness (issue 29, item 2): a worker process samples the next batches with an
adapter at most ``rollout.max_staleness`` optimizer steps old while the trainer updates.

The schedule (``prefzoo/rollout/async_rollouts.py``'s docstring) makes staleness 0 the synchronous run: the same
tokens (the worker samples its own merged copy of the same weights, with the same per-prompt seeds, one thread) and
so the same update, which the first test checks bit for bit.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from prefzoo.errors import RolloutWorkerError
from prefzoo.training.loop import Trainer
from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN, compose
from tests.bounds import gamma
from tests.interrupt import run_until_killed
from tests.rollout import ending_turns, faulty_workers

ARGS = ["algo=grpo", LETTER_REWARD, *TINY_RUN, "trainer.max_steps=4", "trainer.lr=0.05", "rollout.temperature=1.0",
        "eval.before=false", "eval.after=false"]


def _run(tmp_path, name, *extra):
    from safetensors.torch import load_file

    from prefzoo.training.metrics_log import read_metrics

    Trainer(compose([*ARGS, *extra]), tmp_path / name).run()
    rows = read_metrics(tmp_path / name / "metrics.jsonl")
    return rows, load_file(tmp_path / name / "adapter" / "adapter_model.safetensors")


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """The synchronous run (checkpoints every 2 steps: saving does not change the update), shared by the tests that
    compare an asynchronous run with it."""
    return _run(tmp_path_factory.mktemp("sync"), "sync", "trainer.save_every=2")


def test_staleness_zero_is_the_synchronous_update_bit_for_bit(tmp_path, synchronous):
    """GRPO on the tiny model, 4 steps: with rollout.asynchronous and max_staleness 0 every step's reward and loss and
    the final adapter equal the synchronous run's exactly (staleness 0 logged at each step)."""
    sync, a = synchronous
    zero, b = _run(tmp_path, "zero", "rollout.asynchronous=true", "rollout.max_staleness=0")
    assert [(r["reward"], r["loss"]) for r in zero] == [(r["reward"], r["loss"]) for r in sync]
    assert [r["async/staleness"] for r in zero] == [0, 0, 0, 0] and _same(a, b)
    assert any(r["grad_norm"] > 0 for r in sync)  # (the update is not trivially zero)


def test_staleness_two_lags_and_is_corrected_against_its_behaviour_policy(tmp_path):
    """max_staleness 2 with rollout.correction.mode=token_truncate: the rollouts of steps 1..4 were drawn 0, 1, 2, 2
    versions ago (the first two with the starting weights); the worker's log-probs are the behaviour policy's, so the
    mean ratio pi_trainer / pi_behaviour is 1 (to float rounding) at step 1 (drawn by the current weights)
    and visibly not at the stale steps 3 and 4, whose weights the correction reports.

    Step 1's bounds (kind 2 + 3): the logged per-token gap d = max |log pi_trainer - log pi_worker| within
    tests/rollout/test_hf_mismatch.py:token_bound (~3.5e-4, with |log p| < 2 ln V: the default tiny model is nearly
    uniform; measured 1.9e-6), and the mean ratio within expm1(d) of 1 plus the float32 mean's gamma_{n+2} (n <= 48
    tokens). Before: 1e-4, not derived."""
    from tests.models.helpers import tokenizer
    from tests.rollout.test_hf_mismatch import token_bound

    rows, _ = _run(tmp_path, "corrected", "rollout.asynchronous=true", "rollout.max_staleness=2",
                   "rollout.correction.mode=token_truncate")
    assert [r["async/staleness"] for r in rows] == [0, 1, 2, 2]
    d, vocab = rows[0]["engine/logp_diff_max"], len(tokenizer())
    assert d <= token_bound(2 * math.log(vocab), vocab)
    assert abs(rows[0]["correction/ratio_mean"] - 1) <= math.expm1(d) + gamma(2 * 4 * 6 + 2)
    assert rows[0]["correction/frac_rejected"] == 0.0
    assert all(abs(r["correction/ratio_mean"] - 1) > 1e-3 for r in rows[2:])
    assert all("correction/ess" in r for r in rows)


def test_an_asynchronous_run_resumes(tmp_path, synchronous):
    """Checkpoint every 2 steps, killed during step 3, resumed: at staleness 0 the resumed run logs the same steps and
    ends with the same adapter as the uninterrupted one (the synchronous run, which staleness 0 equals bit for bit:
    the test above) (the in-flight rollout is drawn again from the restored
    weights, which are the ones it was drawn with). At staleness 1 the in-flight rollouts of steps 3 and 4 are drawn
    again with the restored weights (step 3's was drawn one version older before): the run continues from the
    checkpoint with the same rows, four steps logged, staleness at most 1."""
    from prefzoo.training.metrics_log import read_metrics

    for k in (0, 1):
        args = [*ARGS, "trainer.save_every=2", "rollout.asynchronous=true", f"rollout.max_staleness={k}"]
        trainer = Trainer(compose(args), tmp_path / f"resumed{k}")
        run_until_killed(trainer, 3)
        assert trainer.source.rollouts is None  # the worker was stopped on the way out
        Trainer(compose([*args, "trainer.resume=true"]), tmp_path / f"resumed{k}").run()
        from safetensors.torch import load_file

        again = load_file(tmp_path / f"resumed{k}" / "adapter" / "adapter_model.safetensors")
        rows = read_metrics(tmp_path / f"resumed{k}" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and max(r["async/staleness"] for r in rows) <= k
        if k == 0:
            assert _same(synchronous[1], again)


# ------------------------------------------------------------------- multi-turn episodes in the worker (issue 48)
#: env=retry, three attempts: every attempt after a wrong one follows the environment's feedback, tokenised into the
#: trajectory (state: outside completion_mask); turns end on the tiny model through tests/rollout/ending_turns.py
MULTI_TURN = [*[a for a in ARGS if not a.startswith("trainer.max_steps")], "env=retry", "env.max_turns=3",
              "trainer.max_steps=3"]
#: what a run logs about its own speed and schedule (the rest must be equal)
CLOCKS = ("time/", "async/", "tokens_per_second", "generated_tokens_per_second")


def _ending_turns(monkeypatch):
    """Turns that end (tests/rollout/ending_turns.py), in this process and in the rollout worker a run spawns."""
    import prefzoo.training.build as build

    ending_turns.end_turns(monkeypatch.setattr)
    monkeypatch.setattr(build, "build_rollout_worker", ending_turns.worker)


def _run_multi_turn(tmp_path, name, *extra):
    from safetensors.torch import load_file

    from prefzoo.training.metrics_log import read_metrics

    Trainer(compose([*MULTI_TURN, *extra]), tmp_path / name).run()
    rows = read_metrics(tmp_path / name / "metrics.jsonl")
    return rows, load_file(tmp_path / name / "adapter" / "adapter_model.safetensors")


def test_multi_turn_at_staleness_zero_is_the_synchronous_run_bit_for_bit(tmp_path, monkeypatch):
    """GRPO with env=retry on the tiny model, 3 steps: with rollout.asynchronous and max_staleness 0 the episodes run in
    the worker (the environment built there from its name), and every logged value but the clocks (reward, loss,
    grad_norm, KL, the episode metrics, ...) and the final adapter equal the synchronous run's exactly. The episodes
    span several turns (the mean of episode/turns is above 1), so trajectories hold the environment's tokens, and the
    update is not trivially zero. Before: refused before the model loaded ("rollout.asynchronous=true cannot run with
    env=retry (multi-turn episodes run in the trainer's process ...)")."""
    _ending_turns(monkeypatch)
    sync, a = _run_multi_turn(tmp_path, "sync")
    zero, b = _run_multi_turn(tmp_path, "zero", "rollout.asynchronous=true", "rollout.max_staleness=0")
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith(CLOCKS)} for r in rows]  # noqa: E731
    assert drop(zero) == drop(sync) and _same(a, b)
    assert [r["async/staleness"] for r in zero] == [0, 0, 0]
    assert all(r["episode/turns"] > 1 for r in sync) and any(r["grad_norm"] > 0 for r in sync)


def test_multi_turn_at_staleness_one_is_corrected_on_the_policys_tokens_only(tmp_path, monkeypatch):
    """max_staleness 1 with rollout.correction.mode=token_truncate and env=retry: the rollouts of steps 1..3 were drawn
    0, 1, 1 versions ago. The worker's log-probs cover the policy's tokens (the environment's are state, 0 there, and
    outside completion_mask): at step 1 (drawn by the current weights) the per-token gap between the trainer's
    recomputation and the worker's is within tests/rollout/test_hf_mismatch.py:token_bound, and the mean ratio within
    expm1(d) + gamma_{n+2} of 1 (n <= 8 rows x 18 policy tokens), as in the single-turn test above; an environment token
    counted by the correction would be off by its whole log-prob (about ln V = 10.8 nats on the near-uniform tiny
    model). At the stale steps 2 and 3 the ratio is off by more than that bound (the weights did move)."""
    from tests.models.helpers import tokenizer
    from tests.rollout.test_hf_mismatch import token_bound

    _ending_turns(monkeypatch)
    rows, _ = _run_multi_turn(tmp_path, "corrected", "rollout.asynchronous=true", "rollout.max_staleness=1",
                              "rollout.correction.mode=token_truncate")
    assert [r["async/staleness"] for r in rows] == [0, 1, 1] and all(r["episode/turns"] > 1 for r in rows)
    d, vocab = rows[0]["engine/logp_diff_max"], len(tokenizer())
    assert d <= token_bound(2 * math.log(vocab), vocab)
    bound = math.expm1(d) + gamma(8 * 3 * 6 + 2)
    assert abs(rows[0]["correction/ratio_mean"] - 1) <= bound
    assert all(abs(r["correction/ratio_mean"] - 1) > bound for r in rows[1:])


def test_an_environment_that_exits_in_the_worker_is_the_synchronous_runs_one_line(tmp_path, monkeypatch, capsys):
    """A text environment whose ``step`` calls ``sys.exit()`` (tests/environments/faulty_envs.py:StepExits), its first
    step on step 1's first ended turn: run through the command line's entry point in this process, synchronously and
    with the episodes in the rollout worker. Both exit with status 2 and the same one line, word for word
    (``prefzoo: error: env: StepExits.step raised SystemExit (sys.exit(None)) at faulty_envs.py:N, in the episode of
    prompt i of 2, sample j, at turn 1; ... during training step 1``). Before: refused before the model loaded (the
    combination did not run); with the refusal lifted and the worker's error sent back as text alone, the asynchronous
    line was another: "prefzoo: error: the rollout worker failed on step 1: env: StepExits.step raised ..." (a
    RolloutWorkerError, without "during training step 1")."""
    from prefzoo import cli
    from tests.test_config import composed
    from tests.test_faults_round4 import GRPO, one_error_line

    _ending_turns(monkeypatch)
    lines = []
    for name, extra in (("sync", []), ("async", ["rollout.asynchronous=true", "rollout.max_staleness=0"])):
        monkeypatch.setattr(cli, "run_dir", lambda: tmp_path / name)
        cfg = composed(*GRPO, "env=custom", "env.target=tests.environments.faulty_envs:StepExits", *extra)
        with pytest.raises(SystemExit) as stop:
            cli.run_from_hydra(cfg)
        lines.append(one_error_line((stop.value.code, capsys.readouterr().err),
                                    "StepExits.step raised SystemExit (sys.exit(None))"))
    assert lines[0] == lines[1] and "at turn 1" in lines[0] and "during training step 1" in lines[0]


def test_an_environment_that_cannot_travel_back_is_named_in_the_worker():
    """An instance that stops pickling after the pre-flight's check (a lock taken in ``step``): the worker checks a
    batch before it queues it, and the run stops with one EnvironmentFailure naming the class and the way out, where a
    queue's own pickling error is printed in its feeder thread and the message lost (the trainer would wait for
    rollout.async_timeout, 600 s). In process: the worker's check on a one-episode batch."""
    import threading

    from prefzoo.errors import EnvironmentFailure
    from prefzoo.rollout.async_rollouts import _check_sendable
    from prefzoo.types import EpisodeLog, SequenceBatch
    from tests.environments.envs import GuessEnv

    env = GuessEnv()
    ids, mask = torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    batch = SequenceBatch(ids, mask, ids, mask, episodes=[EpisodeLog(messages=[], answer="", environment=env)])
    _check_sendable(batch)
    env.lock = threading.Lock()
    with pytest.raises(EnvironmentFailure, match=r"a GuessEnv instance cannot be sent from the rollout worker to the "
                                                 r"trainer \(TypeError: cannot pickle '_thread.lock' object\)") as err:
        _check_sendable(batch)
    assert "rollout.asynchronous=false" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ worker faults
# (the worker builds from tests/rollout/faulty_workers.py, which imports torch alone: a spawned worker imports the
# module its builder lives in, and this one imports the whole training loop)
def _submit(rollouts):
    from prefzoo.types import PromptBatch, SamplingParams

    prompts = PromptBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool), {})
    rollouts.submit(0, prompts, 2, SamplingParams(), [0], 0)


@pytest.mark.parametrize("fault,needle", [
    ("dies", "the rollout worker (pid"), ("hangs", "sent nothing for 3 s (rollout.async_timeout)"),
    ("raises", "failed on step 1: ValueError: the tool server is down"),
])
def test_a_worker_that_dies_hangs_or_fails_stops_the_run_in_one_line(fault, needle):
    """The worker exits (code 3), sleeps past the timeout (3 s) or raises while sampling step 1: take() raises one
    RolloutWorkerError naming what happened and the way to resume, within the timeout; the worker is gone after."""
    from functools import partial

    from prefzoo.rollout.async_rollouts import AsyncRollouts

    rollouts = AsyncRollouts(partial(faulty_workers.faulty, fault), max_staleness=0, timeout=3, start_timeout=120)
    _submit(rollouts)
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError) as err:
        rollouts.take(0)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert time.monotonic() - start < 20
    if fault == "dies":
        assert "exit code 3" in str(err.value) and "resume with trainer.resume=true" in str(err.value)
    rollouts.close()
    assert not rollouts.process.is_alive()


def test_a_worker_that_cannot_build_its_model_is_named():
    from prefzoo.rollout.async_rollouts import AsyncRollouts

    with pytest.raises(RolloutWorkerError, match="OSError: no such model folder: /nowhere"):
        AsyncRollouts(faulty_workers.cannot_build, max_staleness=0, timeout=3, start_timeout=120)


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.asynchronous=true", "rollout.max_staleness=-1"], "rollout.max_staleness=-1"),
    (["rollout.asynchronous=true", "model.lora.enabled=false"], "the worker receives the LoRA adapter"),
    (["rollout.asynchronous=true", "rollout.async_timeout=0"], "rollout.async_timeout=0.0 is invalid"),
])
def test_what_the_worker_cannot_serve_is_refused_before_anything_loads(overrides, needle):
    from prefzoo.errors import ConfigError

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        compose(["algo=grpo", *TINY_RUN, *overrides])


def test_the_issues_spelling_names_the_key():
    from prefzoo.cli import check_renamed_keys
    from prefzoo.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.async was renamed: use rollout.asynchronous"):
        check_renamed_keys(["algo=grpo", "rollout.async=true"])
