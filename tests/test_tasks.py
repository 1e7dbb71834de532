"""Generated retrieval tasks: exact lengths, needle depth, seeding, answers, errors."""

import pytest
from toy_tokenizer import ToyTokenizer

from kvlab.tasks import TASKS, Encoder, TaskError, make_item, make_items
from kvlab.tasks.prompt import chat_frame, fill_lines
from kvlab.tasks.words import ADJECTIVES, NOUNS


@pytest.fixture(scope="module")
def enc():
    return Encoder(ToyTokenizer())


def _text(enc, ids):
    return enc.tokenizer.decode(ids)


def test_word_lists_are_distinct_lowercase_words():
    for words in (ADJECTIVES, NOUNS):
        assert len(words) == len(set(words)) >= 150
        assert all(w.isalpha() and w.islower() for w in words)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [700, 701, 733, 1500])
def test_prompt_has_exactly_the_requested_length(enc, task, length):
    item = make_item(task, enc, length, depth=0.5, sample=0)
    assert item.n_prompt_tokens == length
    assert item.length == length


def test_fill_lines_hits_every_budget(enc):
    for budget in range(0, 300):
        lines = fill_lines(enc, "The grass is green.", budget)
        assert sum(map(len, lines)) == budget
        assert all(enc.decode(line).endswith("\n") for line in lines)


def test_prompt_is_rendered_in_the_chat_template(enc):
    item = make_item("niah_single", enc, 800, depth=0.5)
    context = _text(enc, item.context_ids)
    question = _text(enc, item.question_ids)
    assert context.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\n" in context
    assert question.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert _text(enc, item.answer_prefix_ids).startswith("The special magic number for ")


def test_plain_frame_without_chat_template():
    enc = Encoder(ToyTokenizer(chat=False))
    assert not enc.frame.templated
    item = make_item("niah_single", enc, 600)
    assert "<|im_start|>" not in _text(enc, item.context_ids + item.question_ids)
    assert item.n_prompt_tokens == 600
    assert chat_frame(ToyTokenizer(), use_chat_template=False).head == ""


def test_needle_sits_in_the_context_with_the_gold_value(enc):
    item = make_item("niah_single", enc, 900, depth=0.3, sample=1)
    (value,) = item.references
    assert len(value) == 7 and value.isdigit()
    context = _text(enc, item.context_ids)
    key = item.meta["key"]
    assert f"One of the special magic numbers for {key} is: {value}." in context
    assert key in _text(enc, item.question_ids)
    assert _text(enc, item.answer_ids) == f" {value}"
    # the toy tokenizer splits " 1234567" into " " + digits: first-token accuracy looks at the digit
    assert item.answer_start == 1 and _text(enc, item.answer_ids[1:2]) == value[0]
    # the recorded token position points at the needle
    pos = item.meta["needle_token_positions"][0]
    assert _text(enc, item.context_ids[pos:]).startswith("One of the special magic numbers")


def test_depth_moves_the_needle_monotonically(enc):
    positions = [make_item("niah_single", enc, 1200, depth=d, sample=0).meta["needle_token_positions"][0]
                 for d in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert positions == sorted(positions) and len(set(positions)) == 5
    n = 1200
    assert positions[0] < 0.15 * n and positions[-1] > 0.8 * n
    mid = make_item("niah_single", enc, 1200, depth=0.5).meta["needle_token_positions"][0]
    assert 0.35 * n < mid < 0.65 * n


def test_items_are_seeded_and_reproducible(enc):
    a = make_item("niah_multikey", enc, 800, depth=0.5, sample=3, base_seed=7)
    b = make_item("niah_multikey", Encoder(ToyTokenizer()), 800, depth=0.5, sample=3, base_seed=7)
    assert a == b
    c = make_item("niah_multikey", enc, 800, depth=0.5, sample=4, base_seed=7)
    d = make_item("niah_multikey", enc, 800, depth=0.5, sample=3, base_seed=8)
    assert a.references != c.references and a.references != d.references


def test_multikey_has_distractors_with_other_keys(enc):
    item = make_item("niah_multikey", enc, 1000, depth=0.5, num_distractors=3)
    context = _text(enc, item.context_ids)
    assert context.count("One of the special magic numbers for") == 4
    assert len(set(item.meta["distractor_keys"]) | {item.meta["key"]}) == 4
    assert item.meta["key"] in _text(enc, item.question_ids)


def test_multivalue_lists_values_in_text_order(enc):
    item = make_item("niah_multivalue", enc, 1000, depth=0.2, num_values=4)
    assert len(item.references) == 4
    context = _text(enc, item.context_ids)
    order = sorted(item.references, key=context.index)
    assert _text(enc, item.answer_ids) == " " + ", ".join(order)


def test_variable_tracking_chain_in_order(enc):
    item = make_item("vt", enc, 1000, depth=0.2, num_hops=4)
    assert item.task == "variable_tracking"
    chain = item.meta["chain"]
    assert len(chain) == 5 and list(item.references) == chain
    context = _text(enc, item.context_ids)
    idx = [context.index(f"VAR {name} =") for name in chain]
    assert idx == sorted(idx)
    assert f"VAR {chain[1]} = VAR {chain[0]}." in context


def test_make_items_grid_order(enc):
    items = make_items("niah_single", enc, lengths=[600, 700], depths=[0.1, 0.9], samples=2)
    assert [(i.length, i.depth, i.sample) for i in items] == [
        (L, d, s) for L in (600, 700) for d in (0.1, 0.9) for s in (0, 1)]
    assert len({i.seed for i in items}) == len(items)


def test_scoring_uses_string_match(enc):
    item = make_item("niah_multivalue", enc, 900, depth=0.5)
    refs = item.references
    assert item.score(" " + ", ".join(refs)) == 1.0
    assert item.score(refs[0]) == pytest.approx(0.25)
    assert item.score("no idea") == 0.0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: make_item("niah_single", e, 50), "too short"),
        (lambda e: make_item("niah_single", e, 800, depth=1.5), "depth"),
        (lambda e: make_item("needle_in_space", e, 800), "unknown task"),
        (lambda e: make_item("niah_single", e, 0), "positive"),
        (lambda e: make_item("niah_single", e, 800, colour="red"), "unexpected keyword"),
        (lambda e: make_item("niah_multivalue", e, 800, num_values=0), "num_values"),
    ],
)
def test_bad_input_names_the_fix(enc, call, message):
    with pytest.raises(TaskError, match=message):
        call(enc)


def test_synthetic_model_without_tokenizer_is_a_clear_error():
    with pytest.raises(TaskError, match="tokenizer"):
        Encoder(None)


@pytest.mark.slow(reason="every task at three lengths through SmolLM2's tokenizer")
def test_exact_lengths_with_the_smollm2_tokenizer(smollm2):
    enc = Encoder(smollm2.tokenizer)
    for task in TASKS:
        for length in (1024, 1537, 2048):
            item = make_item(task, enc, length, depth=0.5)
            assert item.n_prompt_tokens == length
    item = make_item("niah_single", enc, 1024, depth=0.5)
    text = enc.tokenizer.decode(list(item.context_ids))
    assert "<|im_start|>user" in text and item.references[0] in text
    # SmolLM2 encodes " 1234567" as " " + seven digits: first-token accuracy is taken at the digit
    assert item.answer_start == 1 and len(item.answer_ids) == 8
