"""Data parallelism without processes: how a global batch is split, how rollouts stay independent of the split,
how metrics are put back together, and which launch configurations are refused before any model loads.

The multi-process runs themselves are in test_data_parallel.py.
"""

import pytest
import torch

from prefzoo import cli
from prefzoo.types import ROLLOUT_SEED_COLUMN, SamplingParams
from prefzoo.errors import ConfigError
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models import loading
from prefzoo.training import distributed, loop
from prefzoo.training.sharding import minibatch_rows, reduce_metrics, rollout_seeds, shard_range
from tests.models.helpers import SPREAD, prompt_batch, tiny_model, tokenizer
from tests.test_config import composed, typed


@pytest.mark.parametrize("n,world", [(4, 2), (5, 2), (7, 3), (3, 3), (8, 1)])
def test_shards_are_contiguous_in_rank_order_and_balanced(n, world):
    """Concatenated in rank order the shards are the global batch, so the processes' rows together are the rows
    of one process; sizes differ by at most one."""
    shards = [shard_range(n, r, world) for r in range(world)]
    assert [i for a, b in shards for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in shards]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_a_process_without_items_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        shard_range(1, 1, 2)


def test_online_shards_keep_every_group_in_one_process():
    """GRPO: the sampler's unit is the prompt, rows are prompt-major (G per prompt): with whole prompts per
    process, the rows of process r are exactly the rows [G*start, G*stop) of the one-process batch."""
    g, prompts, world = 4, 6, 2
    one_process_rows = [(p, k) for p in range(prompts) for k in range(g)]
    rows = []
    for r in range(world):
        start, stop = shard_range(prompts, r, world)
        rows += [(p, k) for p in range(start, stop) for k in range(g)]
    assert rows == one_process_rows


def test_minibatch_rows_partition_a_global_minibatch_over_processes():
    counts = [3, 2, 3]  # local rows per process
    offsets = [0, 3, 5]
    global_minibatch = [6, 0, 4, 2, 7]
    parts = [minibatch_rows(global_minibatch, o, c) for o, c in zip(offsets, counts)]
    assert parts == [[0, 2], [1], [1, 2]]  # local row numbers, in the mini-batch's order
    assert sorted(o + i for o, part in zip(offsets, parts) for i in part) == sorted(global_minibatch)
    assert minibatch_rows([0, 1], 3, 2) == []  # a process may hold no row of a mini-batch


def test_rollout_seeds_depend_on_seed_step_and_global_position_only():
    a = rollout_seeds(0, 3, range(4))
    assert a == rollout_seeds(0, 3, [0, 1, 2, 3])
    assert a[2:] == rollout_seeds(0, 3, range(2, 4))  # process 1 of 2 draws the seeds process 0 of 1 would
    assert len(set(a)) == 4 and all(0 <= s < 2**63 for s in a)
    assert rollout_seeds(0, 4, range(4)) != a and rollout_seeds(1, 3, range(4)) != a


def test_reduce_metrics_rules():
    per_process = [
        (3, {"reward": 1.0, "loss": 0.25, "time/step": 2.0, "tokens_per_second": 100.0, "completion_length_max": 7.0,
             "grad_norm": 0.5, "only_here": 4.0, "note": "x"}),
        (1, {"reward": 5.0, "loss": 0.5, "time/step": 3.0, "tokens_per_second": 50.0, "completion_length_max": 9.0,
             "grad_norm": 0.5}),
    ]
    out = reduce_metrics(per_process)
    assert out["reward"] == pytest.approx((3 * 1.0 + 1 * 5.0) / 4)  # the mean over all rows
    assert out["loss"] == pytest.approx(0.75)  # each process's share of the global loss
    assert out["time/step"] == 3.0 and out["completion_length_max"] == 9.0
    assert out["tokens_per_second"] == 150.0
    assert out["grad_norm"] == 0.5  # the same everywhere after the all-reduce
    assert out["only_here"] == 4.0 and out["note"] == "x"


# ------------------------------------------------------------------ per-prompt sampling
PROMPTS = [[1, 100, 200, 300], [1, 7], [9, 8, 7, 6, 5, 4, 3, 2000, 1000]]


@pytest.fixture(scope="module")
def policy():
    from prefzoo.rollout.engine import HFEngine

    return CausalLMPolicy(tiny_model(initializer_range=SPREAD).eval(), tokenizer(),
                          generator=torch.Generator().manual_seed(0), engine=HFEngine())


def sample(policy, prompts, seeds, g=3):
    batch = prompt_batch(prompts)
    batch.columns[ROLLOUT_SEED_COLUMN] = seeds
    out = policy.sample(batch, g, SamplingParams(max_new_tokens=6))
    return [ids[mask].tolist() for ids, mask in zip(out.completion_ids, out.completion_mask)]


def test_a_prompt_samples_the_same_alone_or_in_any_batch(policy):
    """Prompt 2 with seed 11: its G samples are the same alone, in a batch of three (other lengths, so other
    padding), and in another position; a generator draw in between changes nothing."""
    alone = sample(policy, [PROMPTS[2]], [11])
    policy.generator.manual_seed(123)
    in_batch = sample(policy, PROMPTS, [5, 7, 11])
    reordered = sample(policy, [PROMPTS[2], PROMPTS[0]], [11, 5])
    assert in_batch[6:9] == alone and reordered[0:3] == alone
    assert in_batch[0:3] == reordered[3:6]  # prompt 0 with seed 5, in either batch
    assert len({tuple(r) for r in alone}) > 1  # the G samples of a prompt still differ from each other
    assert sample(policy, [PROMPTS[2]], [12]) != alone  # and the seed matters


def test_the_uniforms_of_a_prompt_come_from_its_own_seed():
    from prefzoo.rollout.generate import prompt_uniforms

    u = prompt_uniforms([3, 4], 2, 5)
    assert u.shape == (4, 5) and float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u[2:], prompt_uniforms([4], 2, 5))


# ------------------------------------------------------------------ launch configurations refused up front
@pytest.mark.parametrize("env,needle", [
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "set fsdp_version: 2"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"},
     "set fsdp_offload_params: false"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true"},
     "model.gradient_checkpointing=true"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "DeepSpeed (ZeRO-2), which needs GPUs"),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "model.dtype"),
    ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, "dynamo_backend"),
    ({"WORLD_SIZE": "3"}, "trainer.batch_size=2 is the GLOBAL batch"),
])
def test_unusable_launch_configurations_fail_before_any_model_loads(monkeypatch, capsys, env, needle):
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def tripwire(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded / the trainer was built before the launch check")

    monkeypatch.setattr(loading, "load_causal_lm", tripwire)
    monkeypatch.setattr(loop, "load_tokenizer", tripwire)
    monkeypatch.setattr(loop, "Trainer", tripwire)
    with pytest.raises(SystemExit) as exit_:
        cli.run_from_hydra(composed("model=tiny", "trainer.device=cpu", "trainer.batch_size=2"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("prefzoo: error: ") and needle in err


@pytest.mark.parametrize("env,installed,quantization,needle", [
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, False, "none",
     "deepspeed package is not installed"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, True, "4bit",
     "ZeRO-3 shards the model's parameters, which 4-bit"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, True, "none",
     "DeepSpeed (ZeRO-2) is not supported"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, True, "4bit", "4-bit (bitsandbytes) weights are not sharded"),
])
def test_gpu_only_configurations_say_what_is_wrong(monkeypatch, env, installed, quantization, needle):
    """On a GPU machine (faked: trainer.device=cuda is only read here), the most specific reason comes first."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    real_find_spec = distributed.importlib.util.find_spec
    monkeypatch.setattr(distributed.importlib.util, "find_spec",
                        lambda name: (object() if installed else None) if name == "deepspeed" else real_find_spec(name))
    cfg = typed("model=tiny", f"model.quantization={quantization}")
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        distributed.check_launch(cfg)


@pytest.mark.parametrize("override,needle", [
    ("rollout.log_mismatch=true", "rollout.log_mismatch=true needs a whole model beside the trainer"),
    ("rollout.dtype=bfloat16", "rollout.dtype=bfloat16 needs a whole model"),
    ("rollout.asynchronous=true", "rollout.asynchronous=true needs a whole model"),
    ("model.quantization=4bit", "4-bit (bitsandbytes) weights are not sharded by fully_shard"),
])
def test_fsdp_refuses_what_needs_a_whole_model_before_any_model_loads(override, needle):
    """trainer.fsdp=true (torchrun's spelling) with a sampler that keeps a whole model of its own, or 4-bit weights:
    one line naming the setting and the way out, from the launch check that runs before any model loads."""
    cfg = typed("model=tiny", "algo=grpo", "trainer.fsdp=true", override)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        distributed.check_launch(cfg)
    assert "\n" not in str(err.value) and ("DDP" in str(err.value) or "Drop" in str(err.value))


def test_fsdp_on_one_process_warns_and_trains_unsharded(monkeypatch, caplog):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level("WARNING"):
        dp = distributed.setup_data_parallel(typed("model=tiny", "trainer.fsdp=true"), torch.device("cpu"))
    assert not dp.enabled and not dp.fsdp and "the launcher started one process" in caplog.text


def test_one_process_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dp = distributed.setup_data_parallel(typed("model=tiny"), torch.device("cpu"))
    t = torch.tensor([1.0, 2.0])
    assert not dp.enabled and dp.is_main and dp.world_size == 1
    assert dp.all_reduce_sum(t) is t and dp.gather_objects(3) == [3] and dp.broadcast_object("x") == "x"


# ------------------------------------------------------------------ accumulate_gradients' data-parallel hooks
@pytest.fixture(scope="module")
def dpo_setup():
    from prefzoo.types import ObjectiveSettings
    from prefzoo.algos.dpo import DPO, DPOConfig
    from prefzoo.data.preference import PreferenceExample, collate_preferences
    from prefzoo.models.lora import wrap_trainable
    from prefzoo.models.reference import make_reference
    from tests.models.helpers import lora_settings

    torch.manual_seed(0)
    model = wrap_trainable(tiny_model(initializer_range=SPREAD), lora_settings(), quantized=False, adapter_path=None,
                           gradient_checkpointing=False)
    policy = CausalLMPolicy(model, tokenizer(), make_reference(model, lora_enabled=True, adapter_loaded=False,
                                                               mode="auto"))
    rows = [([1, 100, 200], [300, 400, 2], [500, 2]), ([1, 7, 8], [12, 2], [13, 14, 2]), ([42], [43, 2], [49, 2])]
    batch = collate_preferences([PreferenceExample(*r) for r in rows], [0, 1, 2], policy.pad_id)
    return DPO(DPOConfig(), ObjectiveSettings(beta=0.1)), policy, batch


def test_no_sync_wraps_every_micro_batch_but_the_last(dpo_setup):
    import contextlib

    from prefzoo.training.step import accumulate_gradients

    algo, policy, batch = dpo_setup
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(torch.is_grad_enabled())
        yield

    policy.model.zero_grad(set_to_none=True)
    accumulate_gradients(algo, policy, batch, 1, no_sync=no_sync)
    assert len(entered) == 2  # 3 micro-batches: the last one all-reduces


def test_a_process_without_rows_joins_the_all_reduce_with_zero_gradients(dpo_setup):
    """A mini-batch may hold no row of this process (num_minibatches > 1): it still runs one forward/backward
    (DDP all-reduces in the backward) with weight 0, so every trainable parameter gets a zero gradient."""
    from prefzoo.training.step import accumulate_gradients

    algo, policy, batch = dpo_setup
    policy.model.zero_grad(set_to_none=True)
    out = accumulate_gradients(algo, policy, batch.select([]), 1, all_reduce=lambda t: t + 3.0, loss_scale=2.0,
                               placeholder=batch.select([0]))
    grads = [p.grad for p in policy.model.parameters() if p.requires_grad]
    assert out == {"loss": 0.0} and grads and all(g is not None and not g.any() for g in grads)
