"""bf16 steps against float32 ones, and what stays float32 (issue 15, item 1; prefzoo.models.precision).

Two bf16 modes, each against the same run in float32 (same tiny Llama, same LoRA matrices, same batch):

* ``autocast`` -- ``model.compute_dtype=bfloat16``: float32 weights, the forwards under autocast;
* ``bf16`` -- ``model.dtype=bfloat16``: the frozen base weights stored in bf16, the LoRA matrices (and their AdamW
  state) float32 ("master weights").

Tolerances, from the theory. bf16 keeps 8 significant bits: each rounding multiplies a value by (1 + d) with
|d| <= u = 2^-8 = 3.9e-3, d about uniform (standard deviation u / sqrt(3)) and independent from one rounding to the
next. A result that goes through M roundings, each with a sensitivity of about 1, carries a relative error of
standard deviation sigma = u sqrt(M / 3) (a random walk; the worst case M u needs every sign aligned). Along the tiny
Llama's path (2 decoder layers) each layer rounds about 19 times: the two RMSNorm outputs; q/k/v, o, gate/up and
down (the weight and the output of each); RoPE; the attention scores, softmax and output; SiLU and the gated
product; two residual adds (under autocast the residual stream stays float32 but every matmul rounds its input and
weight: the same order). With the final norm, the output layer's input and weight, and its output (the fused output
layer runs in bf16 too and rounds each logit once, relative to the label's: ``matmul_dtype`` of
prefzoo.objective.linear_token_logps) that is M_f = 2 x 19 + 4 = 42 roundings for the forward (sigma_f = 1.46e-2),
about as many again in the backward: M = 75 for a gradient (sigma_g = 1.95e-2). Where a quantity's error lands:

* a log-prob x_t = z_y - logsumexp(z) depends on the logits z only through their spread over the vocabulary
  (adding a constant changes nothing); a relative error sigma_f of the last hidden state h and of the output layer W
  moves each logit by about sigma_f s_t, s_t = std_v(z_t) (z = W h: a perturbation of h of random direction spreads
  over the logits as h itself does), and the log-prob by as much (dz_y dominates the softmax-weighted mean). So
  |dx_t| is measured in units of s_t (float32 logits, policy and reference alike);
* a log-ratio r_t = x_t - ref_t: the two errors add (taken as independent, which only overstates them where the
  policy and the reference share the base's roundings): ||dr|| = sigma_f sqrt(sum_t (s_t^2 + s_ref,t^2));
* the loss reads the log-probs only through r (DPO by definition; GRPO at ratio 1 is -mean(A), free of log-probs,
  plus beta sum_t w_t k3(r_t)): to first order dL = sum_t (dL/dr_t) dr_t, of standard deviation
  sigma_f sqrt(sum_t (dL/dr_t)^2 (s_t^2 + s_ref,t^2)), with dL/dr from the float32 run (DPO: autograd, -dL/dref;
  GRPO: beta w_t (1 - e^-r_t), as kl_loss detaches the reference). A relative tolerance on L itself would not be
  derived from anything: GRPO's L is a difference of nearly equal log-probs;
* the gradient of all LoRA matrices together, relative: ||g_bf16 - g_fp32|| / ||g_fp32||, sigma_g.

Each tolerance is 5 standard deviations: eps_f = 5 sigma_f = 7.3e-2 for the first three (per token, max over
tokens, for the log-probs), 5 sigma_g = 9.8e-2 for the gradients (kind 2 of tests/bounds.py, probabilistic: a
Gaussian 5-sigma excursion has probability 6e-7. The runs themselves are deterministic: fixed weights, batch and
one thread, and bf16's rounding dwarfs float32's reordering. The margin to watch is the gradients': measured up to
2 sigma_g below, 40% of the bound, so the model's sigma_g is low there by up to 2x). A real fault is O(1): with the
LoRA A matrices drawn differently in the two runs (a bug of an earlier draft of this test) the gradients' relative
error was 1.1-1.6.

Measured here (initializer_range 0.2: logit spread s = 1.6; LoRA r = 4 with A and B ~ N(0, 0.1)), autocast / bf16,
over the fast paths (fused log-probs, packed rows for DPO, fused LoRA, shared prompts; the fused output layer in
bf16 since 2026-12-06) and the plain ones:

    quantity, in units of                 DPO autocast   DPO bf16       GRPO autocast  GRPO bf16      tolerance
    log-probs (s_t), max over tokens      3.9e-2 3.8e-2  4.0e-2 4.5e-2  3.0e-2 2.9e-2  2.2e-2 2.7e-2  7.3e-2
    log-ratios (sqrt sum s^2 + s_ref^2)   1.5e-2 1.5e-2  1.3e-2 1.4e-2  1.2e-2 1.2e-2  1.0e-2 1.1e-2  7.3e-2
    loss (sqrt sum dL/dr^2 (s^2+s_ref^2)) 2.1e-3 8.3e-5  4.0e-3 7.9e-3  1.6e-3 2.3e-4  6.7e-4 2.5e-3  7.3e-2
    loss, relative (not bounded)          4.9e-4 1.9e-5  9.3e-4 1.8e-3  3.8e-3 5.6e-4  1.6e-3 6.1e-3  -
    LoRA gradients, relative              3.1e-2 3.4e-2  3.3e-2 4.1e-2  1.9e-2 2.0e-2  2.1e-2 2.1e-2  9.8e-2

The log-probs' and log-ratios' errors are what the theory predicts (sigma_f = 1.46e-2 rms; the max over the 24-38
tokens of a run is about 2.5 sigma_f = 3.6e-2); the gradients' reach 2 sigma_g (the backward's sensitivities
exceed 1), still at 40% of the tolerance. ``bench/check_bf16.py`` measures the same on SmolLM2-135M.
"""

from __future__ import annotations

import math

import pytest
from pathlib import Path
import torch

from safetensors.torch import load_file

import prefzoo.models.loading as loading
from prefzoo.training.build import build_policy
from prefzoo.algos.dpo import DPO, DPOConfig
from prefzoo.algos.grpo import GRPO, GRPOConfig
from prefzoo.algos.ppo import PPO, PPOConfig
from prefzoo.config import Config, FastPathConfig, ModelConfig, TrainerConfig, resolve_objective
from prefzoo.data.preference import PreferenceExample, collate_preferences
from prefzoo.errors import ConfigError
from prefzoo.models.policy import CausalLMPolicy, completion_logits
from prefzoo.training.step import accumulate_gradients, optimisation_step
from prefzoo.types import Experience, SamplingParams
from tests.models.helpers import SPREAD, lora_settings, one_thread_fixture, sequence_batch, tokenizer

U = 2.0 ** -8  # bf16's unit roundoff
EPS_LOGPS = 5 * U * math.sqrt(42 / 3)  # 7.3e-2
EPS_GRAD = 5 * U * math.sqrt(75 / 3)  # 9.8e-2
MODES = {"fp32": {}, "autocast": {"compute_dtype": "bfloat16"}, "bf16": {"dtype": "bfloat16"}}
PLAIN = FastPathConfig(fused_logps=False, share_prompts=False, fused_lora=False, gqa_attention=False,
                       merged_rollout=False, padding_free=False)
ROWS = [([1, 100, 200], [300, 400, 2], [500, 2]), ([1, 7, 8, 9, 10, 11], [12, 2], [13, 14, 15, 16, 2]),
        ([42], [43, 44, 45, 2], [46, 47, 2])]


@pytest.fixture(autouse=True)
def _one_thread_and_spread_init(monkeypatch):
    """One torch thread (tests/models/helpers.py), and the tiny Llama drawn with initializer_range 0.2 (its
    predictions then depend on the context, like a trained model's)."""
    real = loading.load_causal_lm

    def spread(name, **kw):
        kw["tiny_kwargs"] = {**(kw.get("tiny_kwargs") or {}), "initializer_range": SPREAD}
        return real(name, **kw)

    monkeypatch.setattr(loading, "load_causal_lm", spread)
    monkeypatch.setattr(loading, "load_causal_lm", spread)  # (load_value_model's)
    yield from one_thread_fixture()


def config(algo_cfg, mode: str, fast: FastPathConfig | None = None, **lora) -> Config:
    m = ModelConfig(name="tiny", lora=lora_settings(**lora), **MODES[mode])
    if fast is not None:
        m.fast = fast
    return Config(algo=algo_cfg, model=m, trainer=TrainerConfig(device="cpu"))


def build(algo, cfg: Config, fresh: bool = False):
    """The run's policy (``prefzoo.training.build.build_policy``); unless ``fresh``, every LoRA matrix set to the same
    N(0, 0.1) draw in every mode (peft draws A from torch's global generator: it would differ between runs)."""
    built = build_policy(cfg, algo.declaration, tokenizer(), torch.device("cpu"))
    if not fresh:
        with torch.no_grad():
            for n, p in built.model.named_parameters():
                if "lora_" in n:
                    g = torch.Generator().manual_seed(len(n) + 1000 * ("lora_A" in n))
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return built


def dpo(mode: str, fast: FastPathConfig | None = None):
    cfg = config(DPOConfig(), mode, fast)
    algo = DPO(cfg.algo, resolve_objective(cfg))
    built = build(algo, cfg)
    return algo, built, collate_preferences([PreferenceExample(*r) for r in ROWS], [0, 1, 2], built.policy.pad_id)


def grpo(mode: str, fast: FastPathConfig | None = None):
    """GRPO with beta = 0.04 (k3 as a loss: the reference is read) on a hand-made rollout of 2 prompts x 2 samples."""
    cfg = config(GRPOConfig(num_samples=2), mode, fast)
    cfg.objective.beta = 0.04
    algo = GRPO(cfg.algo, resolve_objective(cfg), SamplingParams(max_new_tokens=8))
    built = build(algo, cfg)
    s = sequence_batch([[1, 100, 200], [1, 100, 200], [42, 7], [42, 7]],
                       [[300, 400, 2], [500, 2], [43, 44, 45, 46, 2], [47, 2]])
    with torch.no_grad():
        ref = built.policy.ref_logps(s)
    advantages = torch.tensor([1.0, -1.0, 0.7, -0.7])[:, None] * s.completion_mask
    exp = Experience.from_samples(s, rewards=torch.zeros(4), advantages=advantages, loss_mask=s.completion_mask,
                                  old_logps=None, ref_logps=ref)
    return algo, built, exp


def step(make, mode: str, fast: FastPathConfig | None = None):
    """One accumulate_gradients call: (loss, the LoRA gradients flattened in name order (float64), the per-token
    log-probs of the policy and of the reference the loss read (in call order), d loss / d reference log-probs)."""
    algo, built, batch = make(mode, fast)
    policy, pol, ref = built.policy, [], []
    logps, ref_logps = policy.logps, policy.ref_logps

    def keep_ref(x):
        x = x.detach().requires_grad_(True)
        x.retain_grad()
        ref.append(x)
        return x

    def keep_logps(rows, *a, **k):
        out = logps(rows, *a, **k)
        pol.append((out[0], rows))
        return out

    policy.logps, policy.ref_logps = keep_logps, lambda *a, **k: keep_ref(ref_logps(*a, **k))
    loss_of = algo.loss

    def loss_keeping_the_rollout_reference(policy, micro, step):  # GRPO's batch carries the reference log-probs
        if isinstance(micro, Experience) and micro.ref_logps is not None:
            micro.ref_logps = keep_ref(micro.ref_logps)
        return loss_of(policy, micro, step)

    algo.loss = loss_keeping_the_rollout_reference
    loss = accumulate_gradients(algo, policy, batch, len(batch))["loss"][0]
    params = sorted((n, p) for n, p in built.model.named_parameters() if p.requires_grad)
    assert params and all("lora_" in n and p.dtype == torch.float32 for n, p in params)
    grads = torch.cat([p.grad.double().flatten() for _, p in params])
    assert len(pol) == len(ref) == 1 and pol[0][0].shape == ref[0].shape
    dref = ref[0].grad.double() if ref[0].grad is not None else None  # GRPO's kl_loss detaches the reference
    return loss, grads, pol[0][0].detach().double(), ref[0].detach().double(), dref, built, pol[0][1]


@torch.no_grad()
def logit_spread(built, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard deviation over the vocabulary of the logits that predict each completion token, of the policy and
    of the reference (adapter off), Shape (B, T) each: the scale of a log-prob's error (module docstring)."""
    model = built.model
    policy = completion_logits(model, rows).double().std(-1)
    with built.policy.reference.context():
        ref = completion_logits(model, rows).double().std(-1)
    return policy, ref


@pytest.mark.parametrize("algo", ["dpo", "grpo"])
@pytest.mark.parametrize("mode", ["autocast", "bf16"])
@pytest.mark.parametrize("paths", ["fast", "plain"])
def test_the_bf16_step_agrees_with_float32_within_the_derived_tolerances(algo, mode, paths):
    """Loss, per-token log-probs and LoRA gradients of one step in ``mode`` against float32 (module docstring), with
    every fast path on (fused log-probs, packed rows for DPO, fused LoRA, shared prompts) and all off."""
    make = {"dpo": dpo, "grpo": grpo}[algo]
    fast = None if paths == "fast" else PLAIN
    loss32, grad32, x32, ref32, dref32, built32, rows = step(make, "fp32", fast)
    loss, grad, x, ref, _, built, _ = step(make, mode, fast)
    if paths == "fast" and algo == "dpo":
        assert built.policy.padding_free and built32.policy.padding_free  # the packed path is what ran
    counted = rows.completion_mask
    s_x, s_ref = logit_spread(built32, rows)
    lp_err = max(float(((a - b).abs() / s)[counted].max()) for a, b, s in ((x, x32, s_x), (ref, ref32, s_ref)))
    r, r32 = x - ref, x32 - ref32
    spread = (s_x ** 2 + s_ref ** 2).where(counted, 0.0)
    ratio_err = float((r - r32).norm() / spread.sum().sqrt())
    if dref32 is not None:  # DPO: the loss reads r = logps - ref_logps only, so dL/dr = -dL/dref
        d_r = dref32
    else:  # GRPO at ratio 1: beta sum_t w_t k3(r_t), w_t = 1 / (n_i rows); k3'(r) = 1 - exp(-r)
        mask = counted.double()
        d_r = 0.04 * mask / (mask.sum(1, keepdim=True) * mask.shape[0]) * (1 - torch.exp(-r32))
    loss_scale = float((d_r ** 2 * spread).sum().sqrt())
    loss_err = abs(loss - loss32) / loss_scale
    grad_err = float((grad - grad32).norm() / grad32.norm())
    print(f"{algo} {mode} {paths}: loss {loss32:.6f} -> {loss:.6f} (relative {abs(loss - loss32) / abs(loss32):.2e}, "
          f"in units of its scale {loss_err:.2e}); log-probs {lp_err:.2e}; log-ratios {ratio_err:.2e}; "
          f"gradients {grad_err:.2e}; spread {float(s_x[counted].mean()):.2f}")
    assert lp_err <= EPS_LOGPS
    assert ratio_err <= EPS_LOGPS
    assert loss_err <= EPS_LOGPS
    assert grad_err <= EPS_GRAD


def matmul_dtypes(fn) -> dict[str, set[torch.dtype]]:
    """The dtypes every aten matmul ran in while ``fn()`` ran, split into the output layer's (a dimension equal to
    the vocabulary) and the rest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    vocab = len(tokenizer())
    seen: dict[str, set[torch.dtype]] = {"head": set(), "body": set()}
    matmuls = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
               torch.ops.aten.linear}  # (linear arrives whole under inference mode: the reference pass)

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket in matmuls:
                mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
                seen["head" if any(vocab in a.shape for a in mats) else "body"].add(mats[-1].dtype)
            return func(*args, **(kwargs or {}))

    with Watch():
        fn()
    return seen


@pytest.mark.parametrize("algo", ["dpo", "grpo"])
def test_a_bf16_step_runs_its_output_layer_in_bf16_and_a_float32_step_in_float32(algo):
    """model.dtype=bfloat16 and autocast: the fused output layer's matmuls (forward, reference, the gradient) in bf16 too
    (``bench/profile_bf16.py``: left in float32 they were 15% of a SmolLM2 step's FLOPs and about half its matmul
    time on bf16 hardware); the float32 model's stay float32. (The LoRA low-rank term of the fused layer is float32
    in the float32 run only.)"""
    for mode, want in (("bf16", {torch.bfloat16}), ("autocast", {torch.bfloat16}), ("fp32", {torch.float32})):
        algo_obj, built, batch = (dpo if algo == "dpo" else grpo)(mode)
        accumulate_gradients(algo_obj, built.policy, batch, len(batch))  # (once per model: the fused path's check)
        seen = matmul_dtypes(lambda: accumulate_gradients(algo_obj, built.policy, batch, len(batch)))
        assert seen["head"] == want, (mode, seen)
        if mode != "fp32":
            assert torch.bfloat16 in seen["body"]


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_trainable_weights_and_their_optimizer_state_are_float32_after_a_step(mode):
    """After one AdamW step every trainable parameter (the LoRA matrices) and its state (exp_avg, exp_avg_sq) is
    float32; the frozen base weights are bf16 in the bf16 mode (float32 under autocast); log-probs are float32."""
    algo, built, batch = dpo(mode)
    params = [p for p in built.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    before = [p.detach().clone() for p in params]
    optimisation_step(algo, built.policy, batch, opt, None, params, None)
    assert all(p.dtype == torch.float32 for p in params)
    assert any(not torch.equal(p, b) for p, b in zip(params, before))
    for p in params:
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    frozen = {p.dtype for p in built.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16 if mode == "bf16" else torch.float32}
    assert built.policy.logps(batch.chosen)[0].dtype == torch.float32


def test_the_reference_is_the_same_bf16_base_so_it_equals_the_fresh_policy_exactly():
    """model.dtype=bfloat16, a fresh adapter (B = 0): pi = pi_ref, so the policy's log-probs (fused LoRA layers,
    packed rows) equal the adapter-disabled reference's bit for bit: the reference runs the very bf16 weights."""
    cfg = config(DPOConfig(), "bf16")
    algo = DPO(cfg.algo, resolve_objective(cfg))
    built = build(algo, cfg, fresh=True)
    assert built.policy.reference.kind == "adapter_disabled" and built.policy.reference.module is built.model
    batch = collate_preferences([PreferenceExample(*r) for r in ROWS], [0, 1, 2], built.policy.pad_id)
    with torch.no_grad():
        got = built.policy.logps(batch.chosen)[0]
    torch.testing.assert_close(got, built.policy.ref_logps(batch.chosen), rtol=0, atol=0)


def test_modules_to_save_train_in_float32_over_a_bf16_base():
    """model.lora.modules_to_save=[lm_head] over a bf16 base: the trained copy of the output layer is float32 (its
    updates would otherwise be rounded to bf16: 2^-8 of a weight), runs on float32 inputs and hands bf16 back to the
    model; the frozen reference copy starts equal, so the first log-probs equal the reference's exactly. Before:
    the trained lm_head was bfloat16."""
    cfg = config(DPOConfig(), "bf16", modules_to_save=["lm_head"])
    algo = DPO(cfg.algo, resolve_objective(cfg))
    built = build(algo, cfg, fresh=True)
    trained = {n: p.dtype for n, p in built.model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert trained and set(trained.values()) == {torch.float32}, trained
    assert built.policy.reference.kind == "copy"
    batch = collate_preferences([PreferenceExample(*r) for r in ROWS], [0, 1, 2], built.policy.pad_id)
    with torch.no_grad():
        torch.testing.assert_close(built.policy.logps(batch.chosen)[0], built.policy.ref_logps(batch.chosen),
                                   rtol=0, atol=0)
    out = algo.loss(built.policy, batch)
    out.values.mean().backward()
    head = [p for n, p in built.model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in head)


def test_full_fine_tuning_over_bf16_weights_is_refused():
    """Without LoRA every weight trains: stored in bf16 its updates would be rounded away (an AdamW step of lr 1e-5
    moves a weight of 0.03 by 3e-4 of itself, below bf16's 3.9e-3). Before: it trained in pure bf16."""
    cfg = config(DPOConfig(), "bf16")
    cfg.model.lora.enabled = False
    algo = DPO(cfg.algo, resolve_objective(cfg))
    with pytest.raises(ConfigError, match=r"model.dtype=bfloat16.*model.compute_dtype=bfloat16"):
        build_policy(cfg, algo.declaration, tokenizer(), torch.device("cpu"))


def test_the_saved_adapter_is_float32_and_loads_onto_a_float32_base(tmp_path):
    """The adapter of a bf16-base run is written in float32 and peft loads it onto a float32 base: the two give the
    same log-probs up to the base weights' bf16 rounding (the per-token bound eps_f of the module docstring)."""
    from peft import PeftModel

    from tests.models.helpers import tiny_model

    _, built, batch = dpo("bf16")
    built.model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert saved and {t.dtype for t in saved.values()} == {torch.float32}
    base = tiny_model(seed=0, initializer_range=SPREAD)
    loaded = PeftModel.from_pretrained(base, str(tmp_path))
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    with torch.no_grad():
        want = built.policy.logps(batch.chosen)[0]
        got = CausalLMPolicy(loaded, tokenizer()).logps(batch.chosen)[0]
    mask = batch.chosen.completion_mask
    assert float(((got - want).abs() / want.abs().clamp(min=1e-6))[mask].max()) <= EPS_LOGPS


def test_the_value_model_trains_float32_over_a_bf16_base_and_saves_and_loads(tmp_path):
    """PPO over a bf16 base: the value adapter and head are float32, values are float32; the value model written by
    save_pretrained loads back (as a reward model would) onto a bf16 base with its adapter in float32 and gives the
    same values up to bf16 rounding (the loaded model runs peft's LoRA layers, the run the fused ones: the relative
    bound eps_f of the module docstring, on the largest value)."""
    from prefzoo.models.value import load_value_model

    cfg = config(PPOConfig(num_samples=2), "bf16")
    cfg.objective.beta = 0.05
    algo = PPO(cfg.algo, resolve_objective(cfg), SamplingParams(max_new_tokens=8))
    built = build(algo, cfg)
    value = built.policy.value_model
    assert {p.dtype for p in value.parameters()} == {torch.float32}
    s = sequence_batch([[1, 100, 200], [42, 7]], [[300, 400, 2], [43, 44, 45, 46, 2]])
    with torch.no_grad():
        torch.nn.init.normal_(value.head.weight, std=0.1)
        want = built.policy.values(s)
    assert want.dtype == torch.float32
    value.save_pretrained(tmp_path)
    loaded, _ = load_value_model(tmp_path)
    dtypes = {("lora_" in n, p.dtype) for n, p in loaded.model.named_parameters()}
    assert (True, torch.float32) in dtypes and (False, torch.bfloat16) in dtypes
    with torch.no_grad():
        got = loaded(s)
    assert float((got - want).abs().max()) <= EPS_LOGPS * float(want.abs().max())


def test_a_bf16_setting_on_a_device_without_native_bf16_warns(monkeypatch, caplog):
    """This machine (an AVX2 CPU) emulates bf16: a 1000 x 576 x 1536 matmul ran at 34 GFLOP/s in float32 and
    0.8-6 GFLOP/s in bf16, and the SmolLM2 DPO step of bench/check_bf16.py took 249-260 s in either bf16 mode against
    23 s in float32. The run says so (and nothing on a device with native bf16)."""
    import logging

    import prefzoo.models.precision as precision

    for native, expected in ((False, True), (True, False)):
        monkeypatch.setattr(precision, "native_bf16", lambda device, native=native: native)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prefzoo.models.precision"):
            precision.warn_if_emulated({"model.dtype": "bfloat16", "model.compute_dtype": None}, torch.device("cpu"))
        assert ("no native bf16" in caplog.text) is expected
        assert "model.dtype=bfloat16" in caplog.text or not expected


def test_a_float16_setting_on_a_cpu_warns_and_on_a_gpu_does_not(caplog):
    """Hardening round 3, item 5: float16 matmuls are emulated on a CPU (a 512 x 512 x 512 matmul: 213 ms in
    float16, 1.9 ms in float32 on this 2-core AMD EPYC, 2 threads, idle) and the run said nothing, while bf16 got a
    warning. A CUDA device has float16 kernels: no warning."""
    import logging

    import prefzoo.models.precision as precision

    for device, expected in ((torch.device("cpu"), True), (torch.device("cuda"), False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="prefzoo.models.precision"):
            precision.warn_if_emulated({"model.dtype": "float32", "model.compute_dtype": "float16"}, device)
        assert ("model.compute_dtype=float16 on the CPU: CPUs have no float16 matmul kernels" in caplog.text) is expected


def test_auto_picks_bf16_only_where_it_is_native_and_the_base_is_frozen(monkeypatch):
    """``model.dtype=auto`` (prefzoo.models.precision.resolve_auto_dtype): bfloat16 with native bf16 matmuls and LoRA
    on; float32 without native bf16 (emulated bf16 is 5-40x slower), for full fine-tuning (its weights would train in
    bf16) and for 4-bit weights. The reason comes with it (logged once by the trainer)."""
    import prefzoo.models.precision as precision

    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(precision, "native_bf16", lambda device, native=native: native)
        dtype, why = precision.resolve_auto_dtype(True, "none", cpu)
        assert dtype == ("bfloat16" if native else "float32")
        assert ("multiplies bf16 natively" if native else "no native bf16") in why
        assert precision.resolve_auto_dtype(False, "none", cpu)[0] == "float32"
        assert precision.resolve_auto_dtype(True, "4bit", cpu)[0] == "float32"
    precision.check_weight_dtype("auto", lora_enabled=False, trains=True)  # auto is float32 there: not refused


def test_an_auto_run_records_the_dtype_it_used(monkeypatch, tmp_path, caplog):
    """``model.dtype=auto`` is replaced before the run folder is written: config.yaml (and so the resume check) and the
    model card say ``bfloat16`` on a device with native bf16, and the log line says why. One step on the tiny model
    through the Python API (the command line's path)."""
    import logging

    import prefzoo
    import prefzoo.models.precision as precision
    from tests.shared_runs import FIXTURE, ROOT

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    with caplog.at_level(logging.INFO, logger="prefzoo.training.setup"):
        result = prefzoo.train(["algo=sft", "model=tiny", "model.dtype=auto", "data=file", f"data.path={ROOT / FIXTURE}",
                                "data.max_length=96", "data.max_prompt_length=64", "model.lora.r=4",
                                "trainer.max_steps=1", "trainer.batch_size=2", "trainer.device=cpu",
                                "trainer.save_every=0", "trainer.report_to=[none]", "trainer.num_threads=1",
                                "eval.before=false", "eval.after=false"], run_dir=str(tmp_path / "run"))
    run = Path(result.run_dir)
    assert "model.dtype=auto: bfloat16 (this device" in caplog.text
    assert "  dtype: bfloat16" in (run / "config.yaml").read_text()
    assert "**Dtype:** bfloat16" in (run / "adapter" / "README.md").read_text()


def test_a_config_built_without_a_run_resolves_auto_as_a_run_would(monkeypatch):
    """``build_policy`` on a composed config with ``model.dtype=auto`` (a benchmark's or a notebook's path, no run to
    resolve it first): bf16 base weights where bf16 is native, float32 where it is not; the config then says which."""
    import prefzoo.models.precision as precision

    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(precision, "native_bf16", lambda device, native=native: native)
        cfg = Config(algo=DPOConfig(), model=ModelConfig(name="tiny", lora=lora_settings(), dtype="auto"),
                     trainer=TrainerConfig(device="cpu"))
        built = build(DPO(cfg.algo, resolve_objective(cfg)), cfg, fresh=True)
        frozen = {p.dtype for n, p in built.model.named_parameters() if not p.requires_grad}
        assert frozen == {want} and cfg.model.dtype == str(want).removeprefix("torch.")
        assert {p.dtype for p in built.model.parameters() if p.requires_grad} == {torch.float32}


def test_native_bf16_on_a_cpu_needs_bf16_units_not_just_avx512(monkeypatch):
    """oneDNN calls any AVX-512 CPU bf16-capable, but without ``avx512_bf16`` (or AMX, or Arm's ``bf16``) its bf16
    matmuls are converted in software: on this project's Intel Xeon (AVX-512, no avx512_bf16) a 1024^3 matmul ran at
    114 GFLOP/s in float32 and 27 in bf16 (one thread). The flags decide; without /proc/cpuinfo, oneDNN's answer."""
    import prefzoo.models.precision as precision

    cpu = torch.device("cpu")
    for flags, native in (({"avx512f", "avx512_vnni"}, False), ({"avx512f", "avx512_bf16"}, True),
                          ({"amx_tile", "amx_bf16"}, True), ({"asimd", "bf16"}, True), ({"avx2"}, False)):
        monkeypatch.setattr(precision, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert precision.native_bf16(cpu) is native, flags
    monkeypatch.setattr(precision, "cpu_flags", lambda: None)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert precision.native_bf16(cpu) is False
