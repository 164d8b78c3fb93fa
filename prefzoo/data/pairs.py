"""Build the built-in on-policy preference set: the reference model's own samples, labelled by a verifier.

For each prompt of a task (e.g. arithmetic problems), sample k completions from the reference model,
score them with the task's reward (for arithmetic: is the final number right?), and keep the prompts
whose samples the verifier tells apart: ``chosen`` is a best-scored sample that ended by itself,
``rejected`` a worst-scored one, and chosen must score strictly higher (ties broken at random, seeded). Rows are written in the standard conversational preference format, so the result is
an ordinary dataset any preference algorithm (or a user's script) can read.

**Annotators** (``data.pairs.annotator``, :data:`ANNOTATORS`): who labels the pair of each prompt.

* ``gold`` (the default): the verifier, as above (:func:`select_pair`).
* ``longer``: a LENGTH-BIASED annotator (:func:`select_longer_pair`), the biased human labeller of the canonical
  reward-hacking example (note 000, section 2.1: "the reward model might have learned that longer answers are
  preferred (training data was correlated with length)"). It looks at the pair the verifier would label (a
  best-scored and a worst-scored sample) and prefers the LONGER of the two with probability
  ``data.pairs.length_bias`` (else the verifier's better one); where the verifier sees no difference (all right,
  or all wrong) it prefers a longest sample over a shortest one. Length is the completion's token count (its EOS
  included when it ended). Why this design: a reward model trained on these pairs sees length agree with the label
  on most pairs (all the pairs the verifier cannot tell apart, and ``length_bias`` of the others) and
  correctness on fewer (``1 - length_bias`` of the pairs the verifier separates, plus those where the right answer
  is also the longer); and length is a feature a small reward model learns easily, arithmetic correctness a hard
  one. So the proxy it gives rewards rambling, which an RL policy (beta = 0) can push far beyond the lengths of
  the training pairs while the gold (the verifier) falls: the over-optimisation recipe
  ``overoptimisation_length``. ``stats`` report the share of pairs whose chosen is the longer (``chosen_longer``)
  and the share the verifier prefers (``chosen_better``): the two correlations the proxy learns from.
* ``shorter``: the mirror (:func:`select_shorter_pair`): it prefers the SHORTER answer with probability
  ``data.pairs.length_bias``. On "reply with just the number" prompts, where SmolLM2 rambles and the last number
  of a ramble is seldom the answer, concision is at first a real gain; pushed further it is not (an answer cut to
  nothing is never right): the mechanism of the over-optimisation recipe ``overoptimisation_concise``.

When the model never tells two samples of a prompt apart (a random model such as ``model=tiny`` never answers
right), the pairs take the task's known answer (its ``answer`` column) as ``chosen`` against a sampled answer,
with a warning saying so; a task without known answers then stops with a message giving the sample accuracy and
what to change. An empty set is never cached.

The same sampled, graded completions also make the built-in UNPAIRED set (KTO's data,
``train_unpaired.jsonl`` beside the pairs): every sample is a row ``{prompt, completion, label}``, desirable when
the verifier scores it above 0 (for arithmetic: right) and it ended by itself (under ``require_finished``, as a
chosen answer must), undesirable otherwise; with the known-answer fallback the known answers are desirable rows
too. It is written whenever the pairs are built; for a cache made before it existed, a run that asks for it samples
the training prompts again (same seed) and writes it beside the cached pairs, which stay as they are.

Run once with ``python -m prefzoo.cli pairs`` (same overrides as ``train.py``; :func:`prefzoo.cli.build_pairs`);
``train.py`` builds it on first use and caches it under ``$PREFZOO_CACHE/pairs``.

**Shipped pairs** (:data:`SHIPPED`): the set ``make train`` uses -- the default task, model (SmolLM2-135M-Instruct) and
pair settings -- ships with the package, built by ``prefzoo pairs`` with the defaults (``made_by`` in its
``stats.json``: the command, the commit and the machine). A run whose cache key is a shipped folder's copies it into the
cache instead of sampling (12 minutes on 2 CPU cores), saying so; ``prefzoo pairs`` always samples, replacing a
shipped copy in the cache, so the set can be rebuilt and compared (``tests/data/test_shipped_pairs.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from prefzoo.runtime import numerics_environment
from prefzoo.types import SamplingParams
from prefzoo.data.prompts import PromptSet
from prefzoo.errors import DataError

log = logging.getLogger(__name__)


def select_pair(scores: list[float], ended: list[bool], rng: random.Random) -> tuple[int, int] | None:
    """Indices (chosen, rejected) of one group's samples, or None when the group holds no pair.

    chosen: a best-scored sample among those that ended by themselves (EOS); rejected: a worst-scored sample
    (ended or not); the verifier must strictly prefer chosen. Ties are broken at random (``rng``).
    """
    finished = [i for i, e in enumerate(ended) if e]
    if not finished:
        return None
    best, worst = max(scores[i] for i in finished), min(scores)
    if best <= worst:
        return None
    chosen = rng.choice([i for i in finished if scores[i] == best])
    rejected = rng.choice([i for i, s in enumerate(scores) if s == worst])
    return chosen, rejected


def select_longer_pair(scores: list[float], ended: list[bool], lengths: list[int], rng: random.Random,
                       length_bias: float) -> tuple[int, int] | None:
    """Indices (chosen, rejected) of one group's samples as the length-biased annotator labels them, or None.

    The pair: the verifier's (:func:`select_pair`: a best-scored ended sample and a worst-scored one) when the
    verifier tells the samples apart, else a longest ended sample and a shortest sample (ties at random). The
    label: with probability ``length_bias`` (one ``rng.random()`` draw per separated pair) the longer of the pair is
    chosen, else the verifier's better one; a pair the verifier does not separate is labelled by length alone. The
    chosen must have ended (``ended``; all True when ``data.pairs.require_finished=false``): a longer sample that
    did not end leaves the verifier's label. No pair: the verifier separates nothing and no ended sample is
    strictly longer than a shortest one.

    Args:
        scores: the verifier's score of each sample. ended: whether it ended by itself (EOS).
        lengths: its completion length in tokens. length_bias: in [0, 1].
    """
    return _length_biased_pair(scores, ended, lengths, rng, length_bias, longer=True)


def select_shorter_pair(scores: list[float], ended: list[bool], lengths: list[int], rng: random.Random,
                        length_bias: float) -> tuple[int, int] | None:
    """:func:`select_longer_pair`'s mirror: the annotator prefers the SHORTER answer (with probability
    ``length_bias`` of the verifier's pair; a pair the verifier does not separate: a shortest ended sample over a
    longest one). The chosen must have ended, as there. No pair: the verifier separates nothing and no ended sample
    is strictly shorter than a longest one."""
    return _length_biased_pair(scores, ended, lengths, rng, length_bias, longer=False)


def _length_biased_pair(scores, ended, lengths, rng, length_bias, longer: bool) -> tuple[int, int] | None:
    sign = 1 if longer else -1
    gold = select_pair(scores, ended, rng)
    if gold is not None:
        better, worse = gold
        if rng.random() < length_bias and sign * (lengths[worse] - lengths[better]) > 0 and ended[worse]:
            return worse, better
        return better, worse
    finished = [i for i, e in enumerate(ended) if e]
    if not finished:
        return None
    best = max(sign * lengths[i] for i in finished)  # the longest (shortest) ended sample
    worst = min(sign * n for n in lengths)  # against the shortest (longest) of all
    if best <= worst:
        return None
    return (rng.choice([i for i in finished if sign * lengths[i] == best]),
            rng.choice([i for i, n in enumerate(lengths) if sign * n == worst]))


def _verifier_pair(scores: list[float], ended: list[bool], lengths: list[int], rng: random.Random,
                   length_bias: float) -> tuple[int, int] | None:
    return select_pair(scores, ended, rng)


#: ``data.pairs.annotator`` -> how it picks (chosen, rejected) in one prompt's group:
#: ``f(scores, ended, lengths, rng, length_bias)`` (see the module docstring)
ANNOTATORS = {"gold": _verifier_pair, "longer": select_longer_pair, "shorter": select_shorter_pair}


@torch.no_grad()
def sample_and_label(policy, prompts: PromptSet, reward_fn, k: int, params: SamplingParams, batch_size: int,
                     seed: int, progress: bool = True, require_finished: bool = True,
                     known_answer: bool = False, graded: list[dict] | None = None, annotator: str = "gold",
                     length_bias: float = 0.5) -> tuple[list[dict], dict]:
    """Sample k completions per prompt and turn disagreeing groups into preference rows.

    Args:
        policy: anything with ``sample(PromptBatch, k, params)``, ``tokenizer`` and ``pad_id``.
        prompts: the prompts, with the columns ``reward_fn`` needs and ``prompt`` messages in ``columns``.
        reward_fn: ``(prompts, completions, **columns) -> list[float]``.
        require_finished: chosen must have ended by itself (EOS); False: any sample may be chosen (completions cut
            at ``params.max_new_tokens`` are compared as they are, e.g. the first sentences of a review).
        known_answer: when no prompt gives a pair and the prompts have an ``answer`` column, pair each prompt's
            known answer (chosen) with a worst-scored sample of it (:func:`known_answer_pairs`); ``stats`` then
            counts them as ``known_answer_pairs``. A model that finds pairs of its own is not affected.
        graded: a list to which every graded sample is appended as an unpaired row ``{prompt, completion, label,
            reward, <columns>}`` (label: reward > 0 and, under ``require_finished``, ended by itself), followed
            by the known answers of the fallback's pairs as desirable rows; None: not kept.
        annotator: who labels each group's pair (:data:`ANNOTATORS`; ``longer``: :func:`select_longer_pair` with
            ``length_bias``). The known-answer fallback is the verifier's either way.

    Returns:
        (rows, stats): rows ``{prompt, chosen, rejected, chosen_reward, rejected_reward, <columns>}``;
        stats with counts, the mean sample reward, and over the sampled pairs the share whose chosen is the longer
        (``chosen_longer``, in tokens) and the share whose chosen the verifier scores higher (``chosen_better``).
    """
    from tqdm.auto import tqdm

    if annotator not in ANNOTATORS:
        raise DataError(f"data.pairs.annotator={annotator!r} is not an annotator; choose one of: "
                        f"{', '.join(ANNOTATORS)}.")
    label_pair = ANNOTATORS[annotator]
    rng = random.Random(seed)
    rows, rewards_all, worst = [], [], []  # worst: (text, score) of a worst-scored sample of each prompt
    longer = better = 0  # pairs whose chosen is the longer / the verifier's better one
    tok = policy.tokenizer
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc=f"sampling {k} per prompt", disable=not progress, unit="batch"):
        idx = list(range(start, min(start + batch_size, len(prompts))))
        batch = prompts.batch(idx, policy.pad_id).to(policy.device)
        samples = policy.sample(batch, k, params)
        texts = tok.batch_decode(samples.completion_ids.masked_fill(~samples.completion_mask, policy.pad_id),
                                 skip_special_tokens=True)
        cols = {c: [v[i] for i in idx for _ in range(k)] for c, v in prompts.columns.items()}
        prompt_texts = cols.pop("prompt_text", [prompts.texts[i] for i in idx for _ in range(k)])
        scores = [float(s) for s in reward_fn(prompt_texts, texts, **cols)]
        rewards_all += scores
        ended = (~samples.truncated).tolist() if require_finished else [True] * len(texts)
        lengths = samples.completion_mask.sum(-1).tolist()
        for j, i in enumerate(idx):
            group = list(range(j * k, (j + 1) * k))
            if graded is not None:
                graded += [unpaired_row(prompts, i, texts[g], scores[g] > 0 and ended[g], scores[g]) for g in group]
            low = min(scores[g] for g in group)
            worst.append(texts[next(g for g in group if scores[g] == low)])
            pick = label_pair([scores[g] for g in group], [ended[g] for g in group], [lengths[g] for g in group], rng,
                              length_bias)
            if pick is None:
                continue
            c, r = group[pick[0]], group[pick[1]]
            longer, better = longer + (lengths[c] > lengths[r]), better + (scores[c] > scores[r])
            row = {"prompt": prompts.raw[i] if prompts.raw is not None else prompts.texts[i],
                   "chosen": [{"role": "assistant", "content": texts[c]}],
                   "rejected": [{"role": "assistant", "content": texts[r]}],
                   "chosen_reward": scores[c], "rejected_reward": scores[r]}
            row.update({col: v[i] for col, v in prompts.columns.items() if col not in ("prompt", "prompt_text")})
            rows.append(row)
    stats = {"prompts": len(prompts), "samples": len(rewards_all), "pairs": len(rows),
             "mean_sample_reward": sum(rewards_all) / max(1, len(rewards_all)),
             "chosen_longer": longer / max(1, len(rows)), "chosen_better": better / max(1, len(rows))}
    if not rows and known_answer and "answer" in prompts.columns:
        rows = known_answer_pairs(prompts, worst, reward_fn)
        stats.update(pairs=len(rows), known_answer_pairs=len(rows))
        if graded is not None:
            graded += [{**{k: v for k, v in r.items() if k not in ("chosen", "rejected", "chosen_reward",
                                                                     "rejected_reward")},
                         "completion": r["chosen"], "label": True, "reward": r["chosen_reward"]} for r in rows]
    return rows, stats


def unpaired_row(prompts: PromptSet, i: int, text: str, label: bool, reward: float) -> dict:
    """One sampled completion of prompt ``i`` as an unpaired row (the standard conversational form)."""
    row = {"prompt": prompts.raw[i] if prompts.raw is not None else prompts.texts[i],
           "completion": [{"role": "assistant", "content": text}], "label": bool(label), "reward": reward}
    row.update({col: v[i] for col, v in prompts.columns.items() if col not in ("prompt", "prompt_text")})
    return row


#: optional prompt column: the known answer written as a completion in the task's answer format (data=reasoning_gym:
#: ``<answer>...</answer>``); the known-answer pairs take it as ``chosen`` instead of the bare ``answer``
ANSWER_COMPLETION = "answer_completion"


def known_answer_pairs(prompts: PromptSet, rejected: list[str], reward_fn) -> list[dict]:
    """Preference rows with the task's known answer as ``chosen`` against ``rejected[i]``, a sampled answer of
    prompt i, kept where the verifier scores the known answer strictly higher (the fallback of a reference model
    that never answers right, e.g. the random ``model=tiny``). The known answer is the prompt's
    :data:`ANSWER_COMPLETION` column where it has one, else its ``answer``."""
    answers = [str(a) for a in prompts.columns.get(ANSWER_COMPLETION, prompts.columns["answer"])]
    cols = {c: v for c, v in prompts.columns.items() if c not in ("prompt", "prompt_text")}
    both = {c: v + v for c, v in cols.items()}
    scores = [float(x) for x in reward_fn(prompts.texts + prompts.texts, answers + rejected, **both)]
    n, rows = len(prompts), []
    for i in range(n):
        if scores[i] <= scores[n + i]:
            continue
        row = {"prompt": prompts.raw[i] if prompts.raw is not None else prompts.texts[i],
               "chosen": [{"role": "assistant", "content": answers[i]}],
               "rejected": [{"role": "assistant", "content": rejected[i]}],
               "chosen_reward": scores[i], "rejected_reward": scores[n + i]}
        row.update({col: v[i] for col, v in cols.items()})
        rows.append(row)
    return rows


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.rename(path)


def unpaired_path(train_path: Path) -> Path:
    """The built-in unpaired rows (every graded training sample) beside the cached training pairs."""
    return train_path.with_name("train_unpaired.jsonl")


#: the pair sets that ship with prefzoo, one folder per cache key (``<task>-<key>``): see the module docstring
SHIPPED = Path(__file__).resolve().parent / "shipped_pairs"
PAIR_FILES = ("train.jsonl", "eval.jsonl", "train_unpaired.jsonl", "stats.json")


def copy_shipped(folder: Path) -> bool:
    """Copy the shipped set of ``folder``'s cache key into ``folder`` (True), or do nothing when none ships (False)."""
    shipped = SHIPPED / folder.name
    if not (shipped / "train.jsonl").is_file():
        return False
    folder.mkdir(parents=True, exist_ok=True)
    for name in PAIR_FILES:
        if (shipped / name).is_file():
            (folder / name).write_bytes((shipped / name).read_bytes())
    made = json.loads((shipped / "stats.json").read_text()).get("made_by", {})
    # the recorded command is quoted as it is (it may hold backquoted commands of its own)
    log.info("using the preference pairs shipped with prefzoo for these settings (made by: %s; on %s); "
             "`prefzoo pairs` rebuilds them from the model", made.get("command", "`prefzoo pairs`"),
             made.get("machine", "another machine"))
    return True


def pairs_seed(cfg) -> int:
    """The seed the built-in pairs are sampled (the reference policy's generator) and labelled with:
    ``data.pairs.seed``, or ``data.seed`` when that is null."""
    return cfg.data.seed if cfg.data.pairs.seed is None else cfg.data.pairs.seed


def pairs_folder(cfg, cache_root: Path) -> Path:
    """The cache folder of the built-in pairs of ``cfg`` (``<cache_root>/pairs/<task>-<key>``): the key hashes the task,
    the pair settings, the model's name and the reward, so other settings build (or find) a set of their own."""
    p = cfg.data.pairs
    pairs_key = dict(vars(p) if not hasattr(p, "_content") else p)
    if pairs_key.get("require_finished", True):  # the default leaves the key (and the caches built before it) as it was
        pairs_key.pop("require_finished", None)
    if pairs_key.get("seed") is None:  # likewise the pairs' own seed: null samples with data.seed, as before it existed
        pairs_key.pop("seed", None)
    if pairs_key.get("annotator", "gold") == "gold":  # likewise the verifier's pairs (length_bias plays no part)
        pairs_key.pop("annotator", None)
        pairs_key.pop("length_bias", None)
    task = {k: getattr(cfg.data, k) for k in ("name", "seed", "num_train", "num_eval", "digits", "ops", "word_problems",
                                              "max_prompt_length")}
    if cfg.data.name == "reasoning_gym":  # (only then: the keys of the other tasks' caches stay as they were)
        from prefzoo.data.reasoning_gym import cache_key_parts

        task.update(cache_key_parts(cfg.data))
    key = cache_key({"task": task,
                     "pairs": pairs_key, "model": cfg.model.name,
                     "reward": [list(cfg.reward.functions), cfg.reward.weights], "version": 4})
    return cache_root / "pairs" / f"{cfg.data.name}-{key}"


def build_or_load_pairs(cfg, tokenizer, build_policy, reward_fn, train_prompts: PromptSet, eval_prompts: PromptSet,
                        cache_root: Path, progress: bool = True, unpaired: bool = False,
                        shipped: bool = True) -> tuple[Path, Path, dict]:
    """Paths of the cached train/eval pair files for this task and model, building them if absent.

    The unpaired rows of the training samples are written beside them (:func:`unpaired_path`); ``unpaired``:
    the caller reads them, so a cache without them (built before they existed) gets them: the training prompts are
    sampled again with the same seed, and only the unpaired file is written (the cached pairs are kept as they are).

    Args:
        cfg: the full config (``data``, ``data.pairs``, ``model.name``, ``reward`` are read).
        build_policy: zero-argument callable returning the reference policy to sample from (called only
            when the pairs must be built).
        shipped: use the set that ships with prefzoo for this cache key (:data:`SHIPPED`) instead of sampling; False
            (``prefzoo pairs``): sample, also over a shipped copy in the cache.
    """
    p = cfg.data.pairs
    folder = pairs_folder(cfg, cache_root)
    train_path, eval_path, stats_path = folder / "train.jsonl", folder / "eval.jsonl", folder / "stats.json"
    have_pairs = _has_rows(train_path) and _has_rows(eval_path)  # (an empty file, cached before this check, is rebuilt)
    if not have_pairs and shipped:
        have_pairs = copy_shipped(folder)
    cached_stats = json.loads(stats_path.read_text()) if have_pairs and stats_path.is_file() else {}
    if not shipped and "made_by" in cached_stats:  # prefzoo pairs: a shipped copy is rebuilt from the model
        have_pairs, cached_stats = False, {}
    if have_pairs and (not unpaired or _has_rows(unpaired_path(train_path))):
        return train_path, eval_path, cached_stats
    policy = build_policy()
    params = SamplingParams(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens)
    start = time.perf_counter()
    stats, built, graded = {}, {}, []
    seed = pairs_seed(cfg)
    splits = [("train", train_prompts, p.num_prompts, train_path), ("eval", eval_prompts, p.eval_prompts, eval_path)]
    for name, prompts, n, path in splits[:1] if have_pairs else splits:  # pairs cached: only the unpaired rows
        log.info("building %s preference pairs: %d prompts x %d samples", name, min(n, len(prompts)),
                 p.num_samples)
        rows, s = sample_and_label(policy, prompts.subset(n), reward_fn, p.num_samples, params,
                                   p.batch_size, seed=seed + (name == "eval"), progress=progress,
                                   require_finished=p.require_finished, known_answer=True,
                                   graded=graded if name == "train" else None, annotator=p.annotator,
                                   length_bias=p.length_bias)
        if not rows:
            raise DataError(no_pairs_message(cfg, name, s))
        if s.get("known_answer_pairs"):
            log.warning("%s preference pairs: model=%s gave no pair of its own (%s over %d samples): %d pairs use the "
                        "task's known answer as chosen against a sampled wrong answer. A random model such as "
                        "model=tiny never answers right; a trained one (model=smollm2) finds its own pairs.",
                        name, cfg.model.name, _accuracy(cfg, s), s["samples"], len(rows))
        built[path] = rows
        stats[name] = s
    write_jsonl(unpaired_path(train_path), graded)  # first: cached pairs imply their unpaired rows
    if have_pairs:
        log.info("wrote the unpaired rows of the cached pairs' training samples (%d rows, %d desirable) in %.0f s",
                 len(graded), sum(bool(r["label"]) for r in graded), time.perf_counter() - start)
        return train_path, eval_path, cached_stats
    stats["train"]["desirable_samples"] = sum(bool(r["label"]) for r in graded)
    for path, rows in built.items():  # only a complete set is cached
        write_jsonl(path, rows)
    stats["seconds"] = round(time.perf_counter() - start, 1)
    stats["sampled_with"] = numerics_environment(policy.device)  # what the same seed's samples also depend on
    stats_path.write_text(json.dumps(stats, indent=2))
    log.info("built preference pairs in %.0f s: %s", stats["seconds"], stats)
    return train_path, eval_path, stats


def _has_rows(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _accuracy(cfg, stats: dict) -> str:
    """The mean sample reward, named "sample accuracy" when the reward is correctness alone."""
    if list(cfg.reward.functions) == ["correctness"] and cfg.reward.name != "model":
        return f"sample accuracy {stats['mean_sample_reward']:.1%}"
    return f"mean sample reward {stats['mean_sample_reward']:.4g}"


def no_pairs_message(cfg, split: str, stats: dict) -> str:
    """Why the built-in pairs of ``split`` came out empty, and what to change (nothing is cached)."""
    p = cfg.data.pairs
    return (f"the built-in {split} preference pairs are empty: among {stats['prompts']} prompts x "
            f"{p.num_samples} samples of model={cfg.model.name} the verifier ({', '.join(cfg.reward.functions)}) "
            f"told no two samples of a prompt apart ({_accuracy(cfg, stats)}), and no known answer of the task "
            "scored higher than a sample either. Nothing was cached. Raise data.pairs.num_samples or data.pairs.temperature, "
            "set data.pairs.require_finished=false, use a model that sometimes does well, or give pairs of your "
            "own with data=file data.path=<pairs.jsonl>.")


if __name__ == "__main__":  # the command line lives in prefzoo.cli (importing it here would make an import circle)
    print("prefzoo: error: this command moved: run `python -m prefzoo.cli pairs [overrides]`", file=sys.stderr)
    raise SystemExit(2)
