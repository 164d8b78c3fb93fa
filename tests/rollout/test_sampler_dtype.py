"""The sampler in another dtype than the trainer (``rollout.dtype``), and the drift metric's pass on fewer steps
(``trainer.kl_metric_every``): the two settings that make GRPO's step cheaper without touching its loss.

* ``rollout.dtype=bfloat16``: the hf engine's merged copy holds every floating weight in bf16. Its merged linear
  weights are ``W + s B A`` computed in float32 and rounded ONCE to bf16: each element is then within half a bf16 unit
  in the last place of the exact float64 merge (bf16 keeps 8 significant bits: for |x| in [2^e, 2^(e+1)) the unit is
  2^(e-7), half of it 2^(e-8); plus the float32 merge's own ~1e-7 relative error). Merging in bf16 arithmetic instead
  (bf16(W) + bf16(s B A), rounded twice) breaks that bound on some elements: checked, so the bound can fail.
* ``trainer.kl_metric_every=N``: at beta = 0 GRPO's loss has no pi_ref term, so the reference pass only feeds the
  ``kl`` metric; with N it runs on logged steps N, 2N, ... and the training is unchanged (the same final adapter, bit
  for bit, as N = 1); 0: never.
"""

from __future__ import annotations

import json

import pytest
import torch

from prefzoo.models.merged import MergedCopy, _lora_layers
from tests.perf.test_fast_lora import IDS, lora_model



def exact_merges(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each adapted layer's W + s B A in float64, from the LoRA model's own tensors (independent of the copy), and
    the magnitude of what the sum adds up, |W| + |s| |B| |A| (what bounds the float32 merge's rounding)."""
    out = {}
    for name, layer in _lora_layers(model.get_base_model()):
        w = layer.base_layer.weight.detach().double()
        size = w.abs()
        for a_name in layer.active_adapters:
            a, b = layer.lora_A[a_name].weight.detach().double(), layer.lora_B[a_name].weight.detach().double()
            w = w + layer.scaling[a_name] * (b @ a)
            size = size + abs(layer.scaling[a_name]) * (b.abs() @ a.abs())
        out[name] = (w, size)
    return out


def within_half_ulp(got: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """|got - exact| <= half a bf16 ulp of exact (2^(floor(log2 |exact|) - 8)) plus the float32 merge's rounding
    (kind 2: W + s B A in float32, r = 4 products, the scaling and the add: gamma_6 u32 of the summands' size, < 2^-21
    x size; 2^-19 x size leaves 4x). Element by element, no thread-dependent sum."""
    value, size = exact
    half_ulp = torch.exp2(torch.floor(torch.log2(value.abs().clamp(min=1e-30))) - 8)
    return (got.double() - value).abs() <= half_ulp + 2.0 ** -19 * size


def test_a_bf16_copy_rounds_the_float32_merge_once_and_shares_no_tensor():
    model = lora_model(torch.float32)
    merged = MergedCopy(model, torch.bfloat16)
    copy = merged.module()
    exact = exact_merges(model)
    copied = dict(copy.named_modules())
    for name, w in exact.items():
        got = copied[name].weight
        assert got.dtype == torch.bfloat16
        assert bool(within_half_ulp(got, w).all()), name
    # merging in bf16 arithmetic (rounded twice) breaks the bound somewhere: the check above can fail
    twice = []
    for name, layer in _lora_layers(model.get_base_model()):
        a_name = layer.active_adapters[0]
        a, b = layer.lora_A[a_name].weight.detach(), layer.lora_B[a_name].weight.detach()
        bf = layer.base_layer.weight.detach().bfloat16() + (layer.scaling[a_name] * (b @ a)).bfloat16()
        twice.append(bool(within_half_ulp(bf, exact[name]).all()))
    assert not all(twice)
    # every floating parameter of the copy is bf16, and none is the trainer's storage
    shared = {p.data_ptr() for p in model.parameters()}
    params = list(copy.named_parameters())
    assert params and all(p.dtype == torch.bfloat16 for _, p in params)
    assert not any(p.data_ptr() in shared for _, p in params)
    # the embedding (not adapted) is the trainer's rounded to bf16, element for element
    embed = model.get_base_model().get_input_embeddings().weight
    assert torch.equal(copy.get_input_embeddings().weight, embed.detach().bfloat16())
    with torch.no_grad():
        logits = copy(input_ids=IDS).logits
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_the_bf16_copy_follows_an_optimizer_step_of_the_adapter_and_of_a_trained_embedding():
    """After one SGD step on the LoRA matrices and on the embedding (made trainable here, as modules_to_save would),
    the copy re-merges: its weights are again the new float32 values rounded once."""
    model = lora_model(torch.float32)
    embed = model.get_base_model().get_input_embeddings().weight
    embed.requires_grad_(True)
    merged = MergedCopy(model, torch.bfloat16)
    merged.module()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS).logits.square().mean().backward()
    opt.step()
    copy = merged.module()
    assert merged.merges == 2
    copied = dict(copy.named_modules())
    for name, w in exact_merges(model).items():
        assert bool(within_half_ulp(copied[name].weight, w).all()), name
    assert torch.equal(copy.get_input_embeddings().weight, embed.detach().bfloat16())


def test_a_float32_copy_is_unchanged_by_the_option():
    """dtype=None and dtype=float32 on a float32 model: the shared-tensor copy, its weights the float32 merge."""
    model = lora_model(torch.float32)
    for dtype in (None, torch.float32):
        copy = MergedCopy(model, dtype).module()
        shared = {p.data_ptr() for p in model.parameters()}
        own = [n for n, p in copy.named_parameters() if p.data_ptr() not in shared]
        assert len(own) == 2 * 7


@pytest.mark.parametrize("overrides, words", [
    (["rollout.dtype=bfloat16", "model.lora.enabled=false"], "rollout.dtype=bfloat16 samples from a merged"),
    (["rollout.dtype=bfloat16", "model.fast.merged_rollout=false"], "model.fast.merged_rollout=true"),
    (["rollout.dtype=half"], "rollout.dtype"),
    (["trainer.kl_metric_every=-1"], "trainer.kl_metric_every=-1"),
    (["trainer.kl_metric_every=2", "objective.kl_budget=3.0"], "set trainer.kl_metric_every=1"),
])
def test_bad_settings_are_one_line_before_any_model_loads(overrides, words):
    from prefzoo.errors import ConfigError
    from tests.algos.hydra_runs import compose

    with pytest.raises(ConfigError) as err:
        compose(["algo=grpo", "model=tiny", *overrides])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_vllm_engine_names_its_own_dtype_key():
    from prefzoo.config import check_rollout_engine
    from prefzoo.errors import ConfigError
    from tests.algos.hydra_runs import compose

    cfg = compose(["algo=grpo", "model=tiny"])
    cfg.rollout.engine, cfg.rollout.dtype = "vllm", "bfloat16"
    with pytest.raises(ConfigError, match="rollout.vllm.dtype=bfloat16"):
        check_rollout_engine(cfg)


def _run(tmp_path, name, *overrides):
    from prefzoo.api import train
    from tests.algos.hydra_runs import LETTER_REWARD, TINY_RUN

    run = tmp_path / name
    train(["algo=grpo", "objective.beta=0", "trainer.max_steps=4", "eval.before=false", "eval.after=false",
           LETTER_REWARD, *TINY_RUN, *overrides, f"hydra.run.dir={run}"])
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    return steps, load_file(str(run / "adapter" / "adapter_model.safetensors"))


def test_kl_metric_every_measures_on_fewer_steps_and_trains_the_same(tmp_path, monkeypatch):
    """Four GRPO steps at beta 0: N = 1 logs kl on steps 1-4 and runs the reference 4 times; N = 2 on steps 2 and 4
    (2 passes); N = 0 never (0 passes). The final adapters are bit-identical (the loss never reads pi_ref at beta 0)."""
    from prefzoo.models.policy import CausalLMPolicy

    calls = []
    original = CausalLMPolicy.ref_logps

    def counted(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(CausalLMPolicy, "ref_logps", counted)
    results = {}
    for every in (1, 2, 0):
        calls.clear()
        steps, adapter = _run(tmp_path, f"every{every}", f"trainer.kl_metric_every={every}")
        results[every] = adapter
        logged = [s["step"] for s in steps if "kl" in s]
        assert logged == {1: [1, 2, 3, 4], 2: [2, 4], 0: []}[every]
        assert len(calls) == {1: 4, 2: 2, 0: 0}[every]
    for every in (2, 0):
        assert results[every].keys() == results[1].keys()
        assert all(torch.equal(results[every][k], results[1][k]) for k in results[1])


def test_a_bf16_sampler_run_trains_and_logs_its_mismatch(tmp_path):
    """``rollout.dtype=bfloat16 rollout.log_mismatch=true``: the run trains 4 steps; the logged mismatch between the
    bf16 sampler and the float32 trainer is larger than any float32 merge's could be (tests/rollout/
    test_hf_mismatch.py:token_bound, ~3.5e-4 nats with |log p| < 2 ln V; measured here 2.4e-3 to 3.8e-3, 2026-12-06;
    before: above 1e-5, a float32 merge's gap then) and finite: the sampler is another policy, measured."""
    import math

    from tests.models.helpers import tokenizer
    from tests.rollout.test_hf_mismatch import token_bound

    steps, _ = _run(tmp_path, "bf16", "rollout.dtype=bfloat16", "rollout.log_mismatch=true")
    assert len(steps) == 4
    diffs = [s["engine/logp_diff_max"] for s in steps]
    vocab = len(tokenizer())
    assert all(token_bound(2 * math.log(vocab), vocab) < d < float("inf") for d in diffs)
