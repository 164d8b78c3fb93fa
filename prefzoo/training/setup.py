"""Build a run's data and rewards from the typed config: the task's prompts, the preference pairs or unpaired rows an
offline plugin trains on (no pairs for an online one), the reward and gold reward, the evaluation's reward and
correctness, and the checks made before any model loads (the reward's columns; one episode of the environment, the
reward functions once on placeholder completions). The model, the engine stack and the policy:
:mod:`prefzoo.training.build`.
"""

from __future__ import annotations

import logging

import torch

from prefzoo.config import Config
from prefzoo.data.files import split_held_out
from prefzoo.data.pairs import build_or_load_pairs, pairs_seed, unpaired_path
from prefzoo.data.preference import PreferenceData, load_table, tokenize_preferences
from prefzoo.data.sft import SFTData, demonstration_rows, sft_format, tokenize_sft
from prefzoo.data.unpaired import UnpairedData, check_one_format, class_counts, is_unpaired, pairs_of, split_pairs, tokenize_unpaired
from prefzoo.data.prompts import PromptSet, tokenize_prompts
from prefzoo.data.tasks import get_task
from prefzoo.errors import ConfigError
from prefzoo.models.loading import cache_dir, load_base_model
from prefzoo.models.policy import CausalLMPolicy
from prefzoo.models.precision import resolve_model_dtype
from prefzoo.rewards import make_reward
from prefzoo.types import LossTokens

log = logging.getLogger(__name__)

BUILTIN_TASKS = ("arithmetic", "sentiment", "reasoning_gym")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu.")
    return torch.device(name)


def resolve_precision(cfg: Config, device: torch.device) -> None:
    """``model.dtype=auto`` replaced, in place, by :func:`prefzoo.models.precision.resolve_auto_dtype`'s choice for
    ``device``, logged once with the reason; the run's ``config.yaml``, its resume check and its model card then
    record what was used. Any other value is left as it is."""
    dtype, why = resolve_model_dtype(cfg.model, device)
    if why is not None:
        log.info("model.dtype=auto: %s (%s)", dtype, why)


def task_prompts(cfg: Config, tokenizer) -> tuple[PromptSet, PromptSet]:
    """(train, held-out) prompt sets of the configured task or prompt file."""
    d = cfg.data
    if d.name == "model":  # data=model (reward=model's default): the reward model's own task or prompt file
        from prefzoo.rewards.model import reward_model_data

        d = reward_model_data(cfg.reward.path, d)
    if d.name in BUILTIN_TASKS:
        kwargs = {"num_train": d.num_train, "num_eval": d.num_eval, "seed": d.seed}
        if d.name == "arithmetic":
            kwargs.update(digits=d.digits, ops=tuple(d.ops), word_problems=d.word_problems)
        task = reasoning_gym_task(cfg) if d.name == "reasoning_gym" else get_task(d.name, **kwargs)
        train = tokenize_prompts(task.to_dataset("train"), tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.name} task")
        held = tokenize_prompts(task.to_dataset("eval"), tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.name} eval")
        return train, held
    if not d.path:
        raise ConfigError(f"data={d.name} needs data.path=<file or dataset name>.")
    table = load_table(d.path, d.split)
    if d.eval_split:
        held_table = load_table(d.path, d.eval_split)
    else:
        table, held_table = split_held_out(table, d.eval_fraction, d.seed, d.path)
    train = tokenize_prompts(table, tokenizer, d.max_prompt_length, d.on_bad_row, d.path)
    warn_if_smaller_than_batch(len(train), cfg.trainer.batch_size, f"{d.path}: the training prompts")
    return train, tokenize_prompts(held_table, tokenizer, d.max_prompt_length, d.on_bad_row, f"{d.path} (held out)")


def reasoning_gym_task(cfg: Config):
    """``data=reasoning_gym``'s task (:mod:`prefzoo.data.reasoning_gym`), after checking the reward scores it."""
    from prefzoo.data.reasoning_gym import check_reward_choice, reasoning_gym_task as build

    check_reward_choice(cfg.data.name, cfg.reward.name)
    return build(cfg.data)


def preference_data(cfg: Config, tokenizer, reward_fn, train_prompts: PromptSet | None, eval_prompts: PromptSet | None,
                    device: torch.device, shipped: bool = True) -> tuple[PreferenceData, dict]:
    """Tokenised preference pairs: a user's file, or the built-in on-policy pairs of the task (built once, or the set
    shipped with prefzoo for these settings; ``shipped=False``: sampled from the model)."""
    d = cfg.data
    stats: dict = {}
    if d.name in BUILTIN_TASKS and not d.path:
        train_path, eval_path, stats = builtin_pairs(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device,
                                                     shipped=shipped)
        train_table, eval_table = load_table(str(train_path)), load_table(str(eval_path))
    else:
        train_table, eval_table = data_file_tables(cfg)
    tok = lambda t, name: tokenize_preferences(t, tokenizer, d.max_length, d.max_prompt_length, d.on_bad_row, name)  # noqa
    data = PreferenceData(tok(train_table, d.path or f"{d.name} pairs"), tok(eval_table, f"{d.path or d.name} held-out pairs"))
    warn_if_smaller_than_batch(len(data.train), cfg.trainer.batch_size, f"{d.path or d.name}: the training pairs")
    return data, stats


def builtin_pairs(cfg: Config, tokenizer, reward_fn, train_prompts, eval_prompts, device: torch.device,
                  unpaired: bool = False, shipped: bool = True):
    """(train path, eval path, stats) of the task's built-in pairs, built from the reference model once
    (:func:`prefzoo.data.pairs.build_or_load_pairs`; ``unpaired``: with their unpaired rows beside them)."""
    def reference_policy():
        from prefzoo.models.merged import merged_copy
        from prefzoo.rollout.engine import HFEngine

        gen = torch.Generator(device=device).manual_seed(pairs_seed(cfg))  # (data.pairs.seed, else data.seed)
        model = load_base_model(cfg.model, cfg.trainer.seed, tokenizer, device)
        return CausalLMPolicy(model.eval(), tokenizer, generator=gen, engine=HFEngine(merged_copy))

    return build_or_load_pairs(cfg, tokenizer, reference_policy, reward_fn, train_prompts, eval_prompts, cache_dir(),
                               progress=cfg.trainer.progress, unpaired=unpaired, shipped=shipped)


def data_file_tables(cfg: Config):
    """(train, held-out) tables of ``data.path``: its ``data.eval_split``, or ``data.eval_fraction`` held out."""
    d = cfg.data
    if not d.path:
        raise ConfigError(f"data={d.name}: give data.path=<preference file or dataset name>.")
    table = load_table(d.path, d.split)
    if d.eval_split:
        return table, load_table(d.path, d.eval_split)
    return split_held_out(table, d.eval_fraction, d.seed, d.path)


def unpaired_data(cfg: Config, tokenizer, reward_fn, train_prompts: PromptSet | None, eval_prompts: PromptSet | None,
                  device: torch.device) -> tuple[UnpairedData, dict]:
    """Tokenised unpaired training rows and held-out pairs (:mod:`prefzoo.data.unpaired`): a file in the unpaired
    format (its held-out pairs: each prompt's first desirable row against its first undesirable one), a preference
    file split into rows, or the built-in task's graded samples (held out: its built-in pairs). ``stats["rows"]``
    holds the training rows' class counts."""
    d = cfg.data
    stats: dict = {}
    limits = (d.max_length, d.max_prompt_length, d.on_bad_row)
    prefs = lambda t, name: tokenize_preferences(t, tokenizer, *limits, name)  # noqa: E731
    rows = lambda t, name: tokenize_unpaired(t, tokenizer, *limits, name)  # noqa: E731
    if d.name in BUILTIN_TASKS and not d.path:
        train_path, eval_path, stats = builtin_pairs(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device,
                                                     unpaired=True)
        data = UnpairedData(rows(load_table(str(unpaired_path(train_path))), f"{d.name} unpaired samples"),
                            prefs(load_table(str(eval_path)), f"{d.name} held-out pairs"))
    else:
        train_table, eval_table = data_file_tables(cfg)
        check_one_format(train_table.column_names, d.path)
        if is_unpaired(train_table.column_names):
            data = UnpairedData(rows(train_table, d.path), pairs_of(rows(eval_table, f"{d.path} (held out)")))
        else:
            data = UnpairedData(split_pairs(prefs(train_table, d.path)), prefs(eval_table, f"{d.path} held-out pairs"))
    stats = {**stats, "rows": class_counts(data.train)}
    log.info("%s: %d unpaired training rows (%d desirable, %d undesirable), %d held-out pairs", d.path or d.name,
             len(data.train), stats["rows"]["desirable"], stats["rows"]["undesirable"], len(data.eval))
    warn_if_smaller_than_batch(len(data.train), cfg.trainer.batch_size, f"{d.path or d.name}: the training rows")
    return data, stats


def sequence_data(cfg: Config, tokenizer, reward_fn, train_prompts: PromptSet | None, eval_prompts: PromptSet | None,
                  device: torch.device, loss: LossTokens) -> tuple[SFTData, dict]:
    """Tokenised supervised rows (:mod:`prefzoo.data.sft`) and held-out pairs where there are some: a file in any of
    the SFT formats (a preference file: its prompts and chosen completions, its held-out pairs for the preference
    accuracy), a built-in task's demonstrations (``data.demonstrations``: each training prompt with its known answer),
    or the task's built-in pairs' chosen completions (rejection-sampling fine-tuning; held out: its pairs). ``loss``:
    the plugin's declared :class:`~prefzoo.types.LossTokens`."""
    d = cfg.data
    limits = (d.max_length, d.max_prompt_length, d.on_bad_row)
    rows = lambda t, name, fmt: tokenize_sft(t, tokenizer, loss, *limits, name, fmt)  # noqa: E731
    prefs = lambda t, name: tokenize_preferences(t, tokenizer, *limits, name)  # noqa: E731
    stats: dict = {}
    if d.name in BUILTIN_TASKS and not d.path and d.demonstrations:
        data = SFTData(rows(demonstration_rows(train_prompts), f"{d.name} demonstrations", "prompt/completion"))
        fmt = "demonstrations (prompt, known answer)"
    elif d.name in BUILTIN_TASKS and not d.path:
        train_path, eval_path, stats = builtin_pairs(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device)
        data = SFTData(rows(load_table(str(train_path)), f"{d.name} pairs", "pairs"),
                       prefs(load_table(str(eval_path)), f"{d.name} held-out pairs"))
        fmt = "the built-in pairs' chosen completions"
    else:
        train_table, eval_table = data_file_tables(cfg)
        fmt = sft_format(train_table.column_names, d.path)
        data = SFTData(rows(train_table, d.path, fmt),
                       prefs(eval_table, f"{d.path} held-out pairs") if fmt == "pairs" else [])
    counted = sum(len(e.completion_ids) if e.loss_mask is None else sum(e.loss_mask) for e in data.train)
    log.info("%s: %d supervised training rows (%s), %d tokens with a loss, %d held-out pairs", d.path or d.name,
             len(data.train), fmt, counted, len(data.eval))
    warn_if_smaller_than_batch(len(data.train), cfg.trainer.batch_size, f"{d.path or d.name}: the training rows")
    return data, {**stats, "sft_rows": len(data.train), "sft_tokens": counted}


def offline_data(cfg: Config, tokenizer, reward_fn, train_prompts, eval_prompts, device: torch.device,
                 kind: str = "pairs", loss: LossTokens | None = None):
    """What an offline plugin trains on (its declared ``data``): :func:`preference_data`, :func:`unpaired_data` or
    :func:`sequence_data` (with the plugin's declared ``loss`` tokens)."""
    if kind == "sequences":
        return sequence_data(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device, loss)
    fn = unpaired_data if kind == "unpaired" else preference_data
    return fn(cfg, tokenizer, reward_fn, train_prompts, eval_prompts, device)


def warn_if_smaller_than_batch(rows: int, batch_size: int, what: str) -> None:
    """Warn that every step repeats rows when a training set holds fewer rows than ``trainer.batch_size``."""
    if rows < batch_size:
        log.warning("%s are %d, fewer than trainer.batch_size=%d: every step repeats rows of them. Give more rows "
                    "or a smaller trainer.batch_size.", what, rows, batch_size)


def build_reward(cfg: Config):
    """The task's combined reward function (``reward.functions`` weighted by ``reward.weights``)."""
    if cfg.reward.name == "model":
        from prefzoo.rewards.model import reward_model_function

        return make_reward([reward_model_function(cfg.reward.path)], None)
    return make_reward(list(cfg.reward.functions), list(cfg.reward.weights) if cfg.reward.weights else None)


def build_gold_reward(cfg: Config):
    """The evaluation's gold reward (``eval.gold_reward.functions``, weighted), or None when none is configured."""
    gold = cfg.eval.gold_reward
    if not gold.functions:
        return None
    return make_reward(list(gold.functions), list(gold.weights) if gold.weights else None)


def heldout_pair_prompts(cfg: Config, tokenizer) -> PromptSet | None:
    """Offline runs on a data file: the prompts of its held-out rows (the same split as :func:`preference_data`), so
    the shared evaluation can sample answers to them (reward, KL, diversity); a ``messages`` file's prompts are its
    held-out conversations up to their first assistant turn. None, with a warning, when the file's prompts cannot
    serve (no ``prompt`` or ``messages`` column: a text file; over-long prompts)."""
    from prefzoo.errors import DataError

    d = cfg.data
    try:
        if d.eval_split:
            table = load_table(d.path, d.eval_split)
        else:
            table = split_held_out(load_table(d.path, d.split), d.eval_fraction, d.seed, d.path)[1]
        if "prompt" not in table.column_names and "messages" in table.column_names:
            table = table.add_column("prompt", [_before_first_reply(m) for m in table["messages"]])
        return tokenize_prompts(table, tokenizer, d.max_prompt_length, "skip", f"{d.path} (held-out prompts)")
    except DataError as err:
        log.warning("no held-out prompts from %s for the task evaluation (reward, KL, diversity are left out): %s",
                    cfg.data.path, err)
        return None


def _before_first_reply(messages):
    """A conversation's messages before its first assistant turn (all of them without one): its prompt; None (a bad
    prompt, skipped) when that is nothing or the value is not a list of messages."""
    if not isinstance(messages, list):
        return None
    first = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                 len(messages))
    return messages[:first] or None


def check_reward_columns(cfg: Config, prompts: PromptSet | None) -> None:
    """Before the model loads: each of ``reward.functions`` takes the columns of the prompts it will score in
    training or pair building (``prompts``: the training prompts; None when the reward only serves the
    evaluation, which warns about a reward that cannot score its prompts and goes on).

    Raises:
        ConfigError: a reward function cannot take these columns (see
            :func:`~prefzoo.rewards.registry.check_reward_signature`).
    """
    if prompts is None or cfg.reward.name == "model":
        return
    from prefzoo.rewards.registry import check_reward_signature, resolve_reward

    for spec in cfg.reward.functions:
        try:
            check_reward_signature(spec, resolve_reward(spec), list(prompts.columns))
        except ConfigError as err:
            raise ConfigError(f"reward.functions: {err}") from None


#: the completion the reward is called with before training (:func:`probe_reward`)
PLACEHOLDER_COMPLETION = "The answer is 4."


def probe_environment(make_episode, prompts: PromptSet | None, asynchronous: bool = False) -> list | None:
    """Before the model loads (``env=...``): start one episode on each of the first two training rows, as a rollout
    does, and read its ``get_reward()`` (TRL's contract: an episode may end after its first turn, without a tool call,
    so the reward must be readable right after ``reset``), so that a class that cannot be built, or whose ``reset`` or
    ``get_reward`` fails, stops here in one line naming the class and the method; the episodes' environment instances
    (for :func:`probe_reward`'s ``environments=``), or None. With ``asynchronous`` (``rollout.asynchronous=true``: the
    episodes run in the rollout worker, and each episode's environment travels to the trainer with its rollout for the
    reward functions) the instances must also pickle after ``reset``.

    Raises:
        ConfigError: ``__init__``, ``reset`` or ``get_reward`` (``init`` for skyrl-gym) raised (anything but a Ctrl-C),
            ``reset`` returned something else than a string or None, or ``get_reward`` something else than a number;
            with ``asynchronous``, an instance that cannot be pickled.
    """
    import pickle

    from prefzoo.errors import ConfigError, EnvironmentFailure, PrefzooError, describe_error
    from prefzoo.types import PROMPT_MESSAGES, ROLLOUT_SEED_COLUMN

    if make_episode is None or prompts is None or not len(prompts):
        return None
    batch = prompts.batch(list(range(min(2, len(prompts)))), pad_id=0)
    out = []
    for i in range(len(batch)):
        row = {k: v[i] for k, v in batch.columns.items() if k not in ("prompt_text", ROLLOUT_SEED_COLUMN, PROMPT_MESSAGES)}
        row["prompt"] = (batch.columns.get(PROMPT_MESSAGES) or [None] * len(batch))[i]
        try:
            episode = make_episode()
            episode.start(row)
            episode.reward()
        except EnvironmentFailure as err:
            raise ConfigError(f"{err.method} failed on the {('first', 'second')[i]} training row ({err.cause}); fix "
                              "the environment (checked before the model loads: the pre-flight builds it and calls "
                              "reset and get_reward once on the first two training rows).") from None
        except PrefzooError as err:
            raise ConfigError(f"{err} (on the {('first', 'second')[i]} training row; checked before the model "
                              "loads).") from None
        except Exception as err:  # (a shape the wrappers do not cover)
            raise ConfigError(f"the environment failed on training row {i + 1} ({describe_error(err)}); fix it "
                              "(checked before the model loads).") from None
        if asynchronous:
            try:
                pickle.dumps(episode.instance)
            except Exception as err:  # noqa: BLE001 -- pickling user objects raises many kinds
                name = type(episode.instance).__name__
                raise ConfigError(f"rollout.asynchronous=true: a {name} instance cannot be pickled after reset "
                                  f"({describe_error(err)}); the rollout worker sends each episode's environment to "
                                  f"the trainer with its rollout (the reward functions read it): keep {name}'s state "
                                  "picklable (no lambdas, locks or open connections in its attributes), or set "
                                  "rollout.asynchronous=false (checked before the model loads).") from None
        out.append(episode.instance)
    return out


def probe_reward(reward_fn, prompts: PromptSet | None, environments: list | None = None) -> None:
    """Before the model loads: call the run's reward functions once on two training prompts (their columns, as a
    rollout passes them) with a placeholder completion, so that a function that raises, or returns NaN, the wrong
    number of scores, strings or a scalar fails here in one line, not after the model has loaded and the evaluation
    before training has run (minutes on SmolLM2). Reward models (``reward=model``) are not probed.

    Raises:
        RewardError: what the call found (:meth:`prefzoo.rewards.registry.CombinedReward.probe`).
    """
    from prefzoo.rewards.protocol import COMPLETION_IDS
    from prefzoo.rewards.registry import CombinedReward
    from prefzoo.types import ROLLOUT_SEED_COLUMN

    if prompts is None or not len(prompts) or not isinstance(reward_fn, CombinedReward):
        return
    rows = list(range(min(2, len(prompts))))
    batch = prompts.batch(rows, pad_id=0)
    columns = {k: v for k, v in batch.columns.items() if k != ROLLOUT_SEED_COLUMN}
    texts = columns.pop("prompt_text")
    columns[COMPLETION_IDS] = [[0] for _ in rows]
    if environments is not None:  # env=...: TRL-style functions read the conversation and the environment
        from prefzoo.rewards.protocol import COMPLETION_MESSAGES, ENVIRONMENTS

        columns[COMPLETION_MESSAGES] = [[{"role": "assistant", "content": PLACEHOLDER_COMPLETION}] for _ in rows]
        columns[ENVIRONMENTS] = list(environments)
    reward_fn.probe(texts, [PLACEHOLDER_COMPLETION] * len(rows), **columns)


def reward_chosen(cfg: Config, overrides: list[str] | None = None) -> bool:
    """Whether the run's reward is the user's choice, not the default that comes with every config (the arithmetic
    task's exact match): its config differs from :class:`~prefzoo.config.RewardConfig`'s defaults (``reward=sentiment``,
    ``reward.functions=[...]``, weights, a recipe's reward), or the command line names it (``reward=arithmetic``).
    ``overrides``: the command line's overrides; None reads the running Hydra job's (none outside Hydra)."""
    from prefzoo.config import RewardConfig

    if cfg.reward != RewardConfig():
        return True
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    return any(k == "reward" or k.startswith("reward.") for k in keys)


def evaluation_reward(cfg: Config, reward_fn, prompts: PromptSet | None):
    """The reward the held-out evaluation scores answers with: ``reward_fn``, or None when one of its functions cannot
    take the held-out prompts' columns (e.g. ``correctness`` on a preference file without an ``answer`` column):
    then task_reward / sample_reward are left out. A reward the user chose (:func:`reward_chosen`) is named in one
    warning line; the default reward, which a user's own file need not fit, is left out silently. (Training with a
    reward that cannot score its prompts fails earlier: :func:`check_reward_columns`.)"""
    if reward_fn is None or prompts is None or cfg.reward.name == "model":
        return reward_fn
    from prefzoo.rewards.registry import check_reward_signature, resolve_reward

    for spec in cfg.reward.functions:
        try:
            check_reward_signature(spec, resolve_reward(spec), [c for c in prompts.columns if c != "prompt_text"])
        except ConfigError as err:
            if reward_chosen(cfg):
                log.warning("reward.functions: the evaluation leaves out task_reward and sample_reward on %s: %s",
                            cfg.data.path or cfg.data.name, " ".join(str(err).split()))
            else:
                log.debug("the default reward (%s) does not apply to %s: %s", spec, cfg.data.path, err)
            return None
    return reward_fn


def correctness_function(cfg: Config, prompts: PromptSet | None):
    """Exact-match function when the prompts carry an ``answer`` column, else None (reasoning-gym tasks: their
    verifier's score of 1, :func:`~prefzoo.rewards.reasoning_gym.reasoning_gym_accuracy`)."""
    if prompts is None or "answer" not in prompts.columns:
        return None
    from prefzoo.rewards.reasoning_gym import has_columns, reasoning_gym_accuracy

    if has_columns(prompts.columns):
        return reasoning_gym_accuracy
    from prefzoo.rewards.arithmetic import correctness

    return correctness


