"""Tests for the SFT baseline (prefzoo.algos.sft): the token-mean NLL of the chosen completions, no reference.

Pairs of tests/algos/test_dpo.py: chosen A = (1, 2) with log-probs -0.5, -1.0; chosen B = (3,) with -2.0.

Tolerances (tests/bounds.py, kind 1: the claims are exact). The table is float64 (:func:`table`) and SFT keeps float64
through, so a value is its formula to a few roundings of numbers below 3 (u64 = 1.1e-16 relative each): the bound is
1e-12, over 1000x that (0 where nothing is rounded: -log pi is the table entry negated).
"""

import math

import pytest
import torch

from prefzoo.algos.sft import SFT, SFTConfig
from prefzoo.config import Config, resolve_objective
from prefzoo.objective import aggregate_loss
from prefzoo.training.step import accumulate_gradients
from prefzoo.types import LossTokens, ObjectiveSettings
from tests.algos.test_dpo import POLICY, TablePolicy, pairs
from tests.models.helpers import one_thread_fixture


@pytest.fixture(autouse=True)
def _one_torch_thread():
    yield from one_thread_fixture()


def table() -> TablePolicy:
    """tests/algos/test_dpo.py's TablePolicy without a reference, its table in float64."""
    policy = TablePolicy({}, ref=None)
    policy.theta = torch.zeros(16, dtype=torch.float64)
    for token, value in POLICY.items():
        policy.theta[token] = value
    policy.theta.requires_grad_(True)
    return policy


def sft() -> SFT:
    return SFT(SFTConfig(), ObjectiveSettings(beta=0.0))


def test_declaration():
    algo = SFT(SFTConfig(), resolve_objective(Config(algo=SFTConfig())))
    d = algo.declaration
    assert algo.beta == 0.0 and d.reference is False and d.aggregation == "token_mean" and d.has("implicit_rewards")
    assert d.data == "sequences" and d.loss_tokens == LossTokens(completion_only_loss=True, assistant_only_loss=True)


def test_per_token_nll_on_chosen_and_its_token_mean():
    """Per-token losses -log pi on the chosen tokens: A 0.5, 1.0; B 2.0; the token mean (0.5 + 1 + 2) / 3 = 7/6."""
    algo = sft()
    batch = pairs().chosen  # a preference file's rows: SFT reads their prompts and chosen completions
    out = algo.loss(table(), batch)
    assert torch.equal(out.mask, batch.completion_mask)
    torch.testing.assert_close(out.values[out.mask].detach(), torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64),
                               rtol=0, atol=0)
    loss = aggregate_loss(out.values, out.mask, "token_mean", algo.normaliser(batch))
    assert float(loss) == pytest.approx(7 / 6, abs=1e-12)
    assert out.metrics["logps/completion"] == pytest.approx((-1.5 - 2.0) / 2, abs=1e-12)


@pytest.mark.numerics
def test_micro_batches_give_the_gradient_of_the_whole_batch():
    """Micro-batches of 1 pair: the normaliser is the batch's 3 tokens, not each micro-batch's, so the gradient
    is that of the token mean over all 3 tokens: d/dtheta_t = -(count of t) / 3: tokens 1, 2, 3 -> -1/3 each.
    Each gradient entry is one term per micro-batch, accumulated in another order than the whole batch's, in
    float64 (<= 2 u64 x 1/3): within 1e-12; measured 0 at 1 and 2 threads (2026-12-06)."""
    grads = []
    for size in (1, 2):
        policy = table()
        accumulate_gradients(sft(), policy, pairs().chosen, size)
        grads.append(policy.theta.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0][1:4], torch.full((3,), -1 / 3, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(grads[0][4]) == 0.0  # rejected tokens never enter the loss


def test_held_out_rewards_are_mean_log_probs():
    """A: chosen mean -0.75, rejected (3, 4) mean -1.125; B: chosen -2, rejected (4, 4, 1) mean -1/3."""
    c, r = sft().implicit_rewards(table(), pairs())
    torch.testing.assert_close(c, torch.tensor([-0.75, -2.0], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(r, torch.tensor([-1.125, -1 / 3], dtype=torch.float64), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------ the data's masks, on the tiny Llama
def _nll_exact(model, ids: list[int]) -> tuple[torch.Tensor, float]:
    """-log pi(token t | tokens < t) for t = 1 .. n-1 of one unpadded row, Shape (n-1,) float64: the body's hidden
    states from the very call the policy makes on one unpadded row, then the output layer and the log-softmax in
    float64 (independent of prefzoo's fused float32 log-probs). Also the bound of the policy's float32 side per token
    (tests/bounds.py, kind 2): each logit a float32 dot product of d terms, gamma_d sum_k |h_k w_vk| (a log-prob moves
    by at most twice the largest logit error), the log-sum-exp of V terms <= 1 (lambda sqrt(V) u32 relative), z - max z
    rounded (2 u32 max |z|) and the result (u32 |log p|)."""
    from tests.bounds import U32, gamma, probable_sum_bound

    x = torch.tensor([ids])
    mask = torch.ones_like(x)
    with torch.no_grad():
        h = model.model(input_ids=x, attention_mask=mask, position_ids=torch.arange(len(ids))[None],
                        use_cache=False).last_hidden_state[0, :-1].double()
        w = model.lm_head.weight.double()
        z = h @ w.T
        logp = torch.log_softmax(z, -1).gather(1, x[0, 1:, None].long())[:, 0]
        logit_error = gamma(h.shape[1]) * float((h.abs() @ w.abs().T).max())
    bound = 2 * logit_error + probable_sum_bound(w.shape[0], 1.0) + 2 * U32 * float(z.abs().max()) \
        + U32 * float(logp.abs().max())
    return -logp, bound


def _sft_loss(loss_tokens, rows, model):
    """The SFT loss of ``rows`` (one batch) through the data layer, the collate, the plugin and the reduction."""
    import datasets

    from prefzoo.data.sft import collate_sft, tokenize_sft
    from prefzoo.models.policy import CausalLMPolicy
    from tests.models.helpers import tokenizer

    examples = tokenize_sft(datasets.Dataset.from_list(rows), tokenizer(), loss_tokens, 256, 128)
    batch = collate_sft(examples, tokenizer().pad_token_id)
    algo = SFT(SFTConfig(completion_only_loss=loss_tokens.completion_only_loss,
                         assistant_only_loss=loss_tokens.assistant_only_loss), ObjectiveSettings(beta=0.0))
    out = algo.loss(CausalLMPolicy(model, tokenizer()), batch)
    return float(aggregate_loss(out.values, out.mask, "token_mean", algo.normaliser(batch))), examples


@pytest.mark.numerics
def test_prompt_tokens_carry_no_loss_on_the_tiny_model():
    """A prompt/completion row on the tiny Llama (weights spread 0.2: log-probs that depend on the context), as the
    loop trains on it: the SFT loss is the mean NLL of the COMPLETION's tokens only, computed independently from one
    forward of the whole row (``_nll_exact``); with ``algo.completion_only_loss=false`` the mean over every token after
    the first. The two differ by far more than the bound (the prompt's tokens would change the loss), so a prompt
    token with a loss cannot pass. Bound: ``_nll_exact``'s per-token bound (a mean of values each within it is
    within it) plus the mean's float32 sum, gamma_n |mean| (kind 2)."""
    from tests.bounds import gamma
    from tests.models.helpers import SPREAD, tiny_model, tokenizer

    model = tiny_model(initializer_range=SPREAD)
    row = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
            "completion": [{"role": "assistant", "content": "It is 5, I am sure."}]}]
    got, (ex,) = _sft_loss(LossTokens(True, True), row, model)
    ids = ex.prompt_ids + ex.completion_ids
    nll, bound = _nll_exact(model, ids)
    p = len(ex.prompt_ids)
    completion_only, every = float(nll[p - 1:].mean()), float(nll.mean())  # nll[t - 1] is token t's
    assert abs(got - completion_only) <= bound + gamma(len(ids)) * abs(completion_only)
    assert abs(completion_only - every) > 100 * bound
    got_every, (ex_every,) = _sft_loss(LossTokens(False, True), row, model)
    assert ex_every.prompt_ids + ex_every.completion_ids == ids
    assert abs(got_every - every) <= bound + gamma(len(ids)) * abs(every)


@pytest.mark.numerics
def test_only_the_assistant_turns_carry_the_loss_of_a_conversation_on_the_tiny_model():
    """A two-turn conversation (tests/data/test_sft.py's TALK: HEAD, "Yo<|im_end|>", BETWEEN, "A2<|im_end|>") and a
    prompt/completion row in ONE batch (padding and a token_mask: the user's second turn is attended to, not trained
    on). The loss is the mean NLL over the tokens located by hand -- "Yo" + <|im_end|> and "A2" + <|im_end|> of the
    conversation, the completion of the other row -- from one independent forward per row; every other token's NLL
    would change it by more than 100x the bound (checked). Bound as in test_prompt_tokens_carry_no_loss_on_the_tiny_model."""
    from tests.bounds import gamma
    from tests.data.test_sft import BETWEEN, HEAD, TALK
    from tests.models.helpers import SPREAD, tiny_model, tokenizer

    tok = tokenizer()
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    model = tiny_model(initializer_range=SPREAD)
    rows = [{"messages": TALK}, {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]}]
    got, examples = _sft_loss(LossTokens(True, True), rows, model)
    head, yo, mid, a2 = ids(HEAD), ids("Yo") + [tok.eos_token_id], ids(BETWEEN), ids("A2") + [tok.eos_token_id]
    talk = head + yo + mid + a2
    counted_talk = [len(head) + i for i in range(len(yo))] + [len(head + yo + mid) + i for i in range(len(a2))]
    other = examples[1].prompt_ids + examples[1].completion_ids
    counted_other = range(len(examples[1].prompt_ids), len(other))
    nll_talk, bound_talk = _nll_exact(model, talk)
    nll_other, bound_other = _nll_exact(model, other)
    terms = torch.cat([nll_talk[[t - 1 for t in counted_talk]], nll_other[[t - 1 for t in counted_other]]])
    want, bound = float(terms.mean()), max(bound_talk, bound_other) + gamma(len(terms)) * float(terms.abs().mean())
    assert abs(got - want) <= bound
    user_turn = torch.cat([terms, nll_talk[[len(head + yo) + i - 1 for i in range(len(mid))]]])
    assert abs(float(user_turn.mean()) - want) > 100 * bound


# ----------------------------------------------------------------------------------------- files, end to end
FIXTURE_ROWS = "tests/fixtures/arithmetic_pairs.jsonl"


def _format_rows(fmt: str) -> list[dict]:
    """The fixture's 40 pairs in TRL's SFT formats (the chosen reply as the demonstration)."""
    import json
    from pathlib import Path

    pairs = [json.loads(line) for line in Path(FIXTURE_ROWS).read_text().splitlines()]
    return {"text": [{"text": f"{p['prompt'][0]['content']} {p['chosen'][0]['content']}"} for p in pairs],
            "prompt/completion": [{"prompt": p["prompt"], "completion": p["chosen"], "answer": p["answer"]}
                                  for p in pairs],
            "messages": [{"messages": p["prompt"] + p["chosen"]} for p in pairs],
            "pairs": pairs}[fmt]


def test_algo_sft_trains_through_the_loop_on_a_text_a_prompt_completion_and_a_messages_file(tmp_path):
    """``algo=sft data=file data.path=X`` on the fixture's 40 rows in each of TRL's formats, unchanged: 38 training rows
    (2 = ceil(0.05 x 40) held out), one step that moves the adapter (a finite loss, a non-zero gradient). The
    prompt/completion and the (one-turn, assistant only) messages files hold the same demonstrations: their tokens
    with a loss are each training row's reply + EOS, counted here with the tokenizer on the replies of the rows the
    split keeps; the text file counts every token after the first, more."""
    import json

    from prefzoo.data.files import read_file, split_held_out
    from prefzoo.training.loop import Trainer
    from tests.algos.hydra_runs import TINY_RUN, compose
    from tests.models.helpers import tokenizer

    counted = {}
    for fmt in ("text", "prompt/completion", "messages"):
        path = tmp_path / f"{fmt.replace('/', '_')}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in _format_rows(fmt)))
        cfg = compose(["algo=sft", "data=file", f"data.path={path}", *TINY_RUN, "trainer.max_steps=1",
                       "eval.before=false", "eval.after=false"])
        summary = Trainer(cfg, tmp_path / f"run_{path.stem}").run()
        stats, last = summary["data_stats"], summary["final_train_metrics"]
        assert stats["sft_rows"] == 38 and math.isfinite(last["loss"]) and last["grad_norm"] > 0
        counted[fmt] = stats["sft_tokens"]
    train, _ = split_held_out(read_file(str(tmp_path / "prompt_completion.jsonl")), 0.05, 0, "rows")
    replies = [row["completion"][0]["content"] for row in train]
    want = sum(len(tokenizer()(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies)
    assert counted["prompt/completion"] == counted["messages"] == want < counted["text"]
