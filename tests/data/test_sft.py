"""Supervised rows (prefzoo.data.sft): TRL's SFT formats told apart by their columns, and the tokens of each row that
carry the loss. Expected token ids come from the tokenizer on text written here by hand from SmolLM2's chat template
(``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, ``<|im_start|>assistant\\n`` as the generation prompt), never
from the functions under test."""

import datasets
import pytest
import torch

from prefzoo.data.preference import tokenize_preferences
from prefzoo.data.sft import (SFTExample, assistant_spans, collate_sft, conversation_tokens, demonstration_rows,
                              sft_format, tokenize_sft)
from prefzoo.errors import DataError
from prefzoo.types import LossTokens
from tests.data.test_preference import USER, chat_prompt_ids, ids
from tests.models.helpers import tokenizer

DEFAULT = LossTokens(completion_only_loss=True, assistant_only_loss=True)
EVERY_TOKEN = LossTokens(completion_only_loss=False, assistant_only_loss=False)
#: a two-turn conversation with a system prompt
TALK = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]
#: its rendering by SmolLM2's template, in three parts: up to the first reply, the replies and what is between them
HEAD = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
BETWEEN = "\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"


def tokenize(rows, loss=DEFAULT, max_length=256, max_prompt_length=128, on_bad_row="error"):
    return tokenize_sft(datasets.Dataset.from_list(rows), tokenizer(), loss, max_length, max_prompt_length, on_bad_row,
                        "rows.jsonl")


# -------------------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("columns,fmt", [(["text"], "text"), (["prompt", "completion", "answer"], "prompt/completion"),
                                         (["messages", "id"], "messages"), (["prompt", "chosen", "rejected"], "pairs"),
                                         (["chosen", "rejected"], "pairs")])
def test_the_format_is_told_by_the_columns(columns, fmt):
    assert sft_format(columns, "f.jsonl") == fmt


@pytest.mark.parametrize("columns,needle", [
    (["question", "answer"], "f.jsonl has none of the column sets SFT reads (its columns: question, answer); give one of: "
                             "text; prompt + completion; messages; prompt + chosen + rejected"),
    (["prompt"], "(its columns: prompt)"),
    (["text", "prompt", "completion"], "f.jsonl has the columns of several SFT formats (text and prompt/completion)"),
    (["prompt", "completion", "label"], "f.jsonl has a 'label' column beside prompt and completion"),
])
def test_a_table_of_no_or_several_formats_is_refused_in_one_line(columns, needle):
    with pytest.raises(DataError) as err:
        sft_format(columns, "f.jsonl")
    assert needle in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------------------- prompt/completion
def test_prompt_completion_rows_are_tokenised_as_a_pair_s_prompt_and_chosen():
    """A conversational prompt/completion row gives the prompt (chat template, generation prompt) and the reply + EOS,
    the very ids the preference tokeniser gives the same prompt and chosen (SFT on pairs as before)."""
    reply = [{"role": "assistant", "content": "It is 5."}]
    ex, = tokenize([{"prompt": USER, "completion": reply}])
    pair, = tokenize_preferences(datasets.Dataset.from_list([{"prompt": USER, "chosen": reply, "rejected": "6"}]),
                                 tokenizer(), 256, 128)
    assert ex == SFTExample(chat_prompt_ids(USER), ids("It is 5.") + [tokenizer().eos_token_id])
    assert (ex.prompt_ids, ex.completion_ids) == (pair.prompt_ids, pair.chosen_ids)
    from_pairs, = tokenize([{"prompt": USER, "chosen": reply, "rejected": "6"}])
    assert from_pairs == ex


def test_completion_only_loss_false_counts_the_prompt_too():
    """Every token after the first carries the loss: prompt = the first token alone, the completion the rest, no
    mask (all counted)."""
    whole = ids("Q: 2+3=") + ids(" 5") + [tokenizer().eos_token_id]
    ex, = tokenize([{"prompt": "Q: 2+3=", "completion": " 5"}], loss=EVERY_TOKEN)
    assert ex == SFTExample(whole[:1], whole[1:])


def test_a_cut_completion_is_counted_as_truncated():
    ex, = tokenize([{"prompt": "Q: 2+3=", "completion": " five hundred and seven"}], max_length=len(ids("Q: 2+3=")) + 2)
    assert ex.completion_ids == ids(" five hundred and seven")[:2] and ex.truncated


# ------------------------------------------------------------------------------------------------ messages
def test_assistant_turns_are_the_tokens_with_a_loss():
    """TALK renders as HEAD + "Yo<|im_end|>" + BETWEEN + "A2<|im_end|>" + "\\n". With assistant_only_loss the prompt
    is HEAD (nothing before the first reply counts), the completion runs to the last reply's <|im_end|> (the trailing
    newline counts for nothing and is dropped), and exactly the two replies with their <|im_end|> carry the loss."""
    eos = tokenizer().eos_token_id
    yo, mid, a2 = ids("Yo") + [eos], ids(BETWEEN), ids("A2") + [eos]
    assert ids(HEAD + "Yo<|im_end|>" + BETWEEN + "A2<|im_end|>\n") == ids(HEAD) + yo + mid + a2 + ids("\n")  # (pieces)
    ex, = tokenize([{"messages": TALK}])
    assert ex.prompt_ids == ids(HEAD)
    assert ex.completion_ids == yo + mid + a2
    assert ex.loss_mask == [True] * len(yo) + [False] * len(mid) + [True] * len(a2)


def test_assistant_only_loss_false_counts_every_token_after_the_first():
    every = ids(HEAD + "Yo<|im_end|>" + BETWEEN + "A2<|im_end|>\n")
    ex, = tokenize([{"messages": TALK}], loss=EVERY_TOKEN)
    assert ex == SFTExample(every[:1], every[1:])


def test_one_turn_messages_row_equals_its_prompt_completion_row():
    """[user, assistant] as a messages row (assistant only) and as prompt/completion: the same prompt and completion
    ids, so the same loss."""
    reply = {"role": "assistant", "content": "It is 5."}
    a, = tokenize([{"messages": [*USER, reply]}])
    b, = tokenize([{"prompt": USER, "completion": [reply]}])
    assert a == b


def test_spans_are_the_characters_the_reply_adds():
    rendered = HEAD + "Yo<|im_end|>" + BETWEEN + "A2<|im_end|>\n"
    first = len(HEAD)
    second = first + len("Yo<|im_end|>") + len(BETWEEN)
    assert assistant_spans(tokenizer(), TALK, rendered) == [(first, first + 12), (second, second + 12)]


def test_a_template_that_rewrites_past_turns_is_refused():
    """A template that writes earlier replies as "[past]" (as templates that drop past reasoning do): the rendering
    of two turns does not start with the rendering of one, so the first reply cannot be located."""
    tok = tokenizer()
    template, tok.chat_template = tok.chat_template, (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[past]{% else %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    try:
        with pytest.raises(ValueError, match="does not render this conversation's turns as prefixes of one another "
                                             r"\(message 2, the assistant's"):
            conversation_tokens(tok, TALK, assistant_only_loss=True)
        ids_all, mask = conversation_tokens(tok, TALK, assistant_only_loss=False)  # every token: no spans needed
        assert all(mask) and len(ids_all) == len(mask)
    finally:
        tok.chat_template = template


def test_a_conversation_cut_before_its_first_reply_is_a_bad_row():
    with pytest.raises(DataError, match=r"rows.jsonl, row 0: no token with a loss is left within data.max_length"):
        tokenize([{"messages": TALK}], max_length=len(ids(HEAD)))


# ---------------------------------------------------------------------------------------------------- text
def test_text_rows_count_every_token_after_the_first_and_end_with_eos():
    whole = tokenizer()("The sky is blue.")["input_ids"] + [tokenizer().eos_token_id]
    ex, = tokenize([{"text": "The sky is blue."}])
    assert ex == SFTExample(whole[:1], whole[1:])
    cut, = tokenize([{"text": "The sky is blue."}], max_length=3)
    assert cut == SFTExample(whole[:1], whole[1:3], truncated=True)


# --------------------------------------------------------------------------------------------- collating
def test_collated_masks_mark_counted_and_present_tokens():
    """Row 0 counts tokens 1 and 3 of 3; row 1 all of its 2: completion_mask the counted, token_mask the present."""
    batch = collate_sft([SFTExample([5], [1, 2, 3], [True, False, True]), SFTExample([6, 7], [4, 8])], pad_id=0)
    assert batch.prompt_ids.tolist() == [[0, 5], [6, 7]] and batch.completion_ids.tolist() == [[1, 2, 3], [4, 8, 0]]
    assert batch.completion_mask.tolist() == [[True, False, True], [True, True, False]]
    assert batch.token_mask.tolist() == [[True, True, True], [True, True, False]]
    plain = collate_sft([SFTExample([5], [1, 2])], pad_id=0)
    assert plain.token_mask is None and plain.completion_mask.tolist() == [[True, True]]


# ------------------------------------------------------------------------------------------ demonstrations
def test_demonstrations_take_the_answer_in_the_task_s_format():
    from prefzoo.data.prompts import PromptSet

    prompts = PromptSet([[1], [2]], ["a", "b"], {"answer": [5, 7], "answer_completion": ["<answer>5</answer>", "7"]},
                        ["two?", "plain?"])
    assert demonstration_rows(prompts).to_list() == [{"prompt": "two?", "completion": "<answer>5</answer>"},
                                                     {"prompt": "plain?", "completion": "7"}]
    numbers = PromptSet([[1]], ["a"], {"answer": [12]}, [USER])
    assert demonstration_rows(numbers).to_list() == [{"prompt": USER, "completion": "12"}]
    with pytest.raises(DataError, match="needs a task with known answers"):
        demonstration_rows(PromptSet([[1]], ["a"], {}, [USER]))


def test_rows_of_the_right_format_only():
    """Form checks that only the SFT reader makes (files.py checks the type: a string or messages)."""
    for row, needle in [({"text": [{"role": "user", "content": "x"}]}, "text is a list of messages"),
                        ({"messages": "hi"}, "messages is a string"),
                        ({"messages": USER}, "messages has no assistant message"),
                        ({"prompt": USER, "completion": [{"role": "assistant", "content": "a"},
                                                         {"role": "tool", "content": "b"}]},
                         "completion holds 2 messages (assistant, tool)")]:
        with pytest.raises(DataError, match="rows.jsonl, row 0: " + needle.replace("(", r"\(").replace(")", r"\)")):
            tokenize([row])
    ex, = tokenize([{"messages": USER}], loss=EVERY_TOKEN)  # no reply: legal when every token counts
    assert torch.tensor(ex.completion_ids).numel() > 0


def test_a_messages_file_s_held_out_prompts_are_its_conversations_before_the_first_reply(tmp_path):
    """The evaluation's held-out prompts of a messages file (20 rows, 1 held out): the held-out conversation's messages
    before its first assistant turn, chat-templated with the generation prompt, as a prompt/completion file's would be."""
    import json

    from prefzoo.training.setup import heldout_pair_prompts
    from tests.test_config import typed

    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)},
                          {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]}
            for i in range(20)]
    path = tmp_path / "talk.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = heldout_pair_prompts(typed("algo=sft", "data=file", f"data.path={path}", "model=tiny"), tokenizer())
    (raw,) = prompts.raw
    assert raw in [r["messages"][:1] for r in rows] and prompts.prompt_ids == [chat_prompt_ids(raw)]


def test_the_calculator_warm_start_s_demonstrations_are_prompt_completion_rows():
    """python -m prefzoo.environments.demonstrations: two rows per problem, TRL's conversational prompt/completion
    format (no rejected side), which SFT reads: the call, then the product read back after the tool's result."""
    import json

    from prefzoo.environments.demonstrations import calculator_demonstrations

    problem = {"prompt": [{"role": "user", "content": "What is 12 * 34? Reply with just the number."}],
               "question": "What is 12 * 34?", "answer": 408}
    call, answer = calculator_demonstrations([problem])
    assert sft_format(list(call), "demos.jsonl") == "prompt/completion" and set(call) == set(answer)
    assert json.loads(call["completion"][0]["content"].split(">", 1)[1].split("<", 1)[0]) == {
        "name": "calculator", "arguments": {"expression": "12 * 34"}}
    assert answer["prompt"][-1] == {"role": "tool", "name": "calculator", "content": "408"}
    assert answer["completion"] == [{"role": "assistant", "content": "408"}]
    a, b = tokenize([call, answer], max_prompt_length=400, max_length=512)
    assert b.completion_ids == ids("408") + [tokenizer().eos_token_id] and a.loss_mask is None
