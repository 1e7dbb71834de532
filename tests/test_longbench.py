"""LongBench-format files: loading, validation errors naming path and field, prompts, scoring."""

import json

import pytest
from toy_tokenizer import ToyTokenizer

from kvlab.tasks import Encoder
from kvlab.tasks.longbench import (
    DATASETS,
    LongBenchError,
    load_longbench,
    longbench_item,
    longbench_items,
    middle_truncate,
)


def _line(**kw):
    base = {"input": "Who wrote the letter?", "context": "Alice wrote the letter to Bob. " * 20,
            "answers": ["Alice"], "all_classes": None, "dataset": "hotpotqa", "length": 120,
            "language": "en", "_id": "abc"}
    base.update(kw)
    return base


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def enc():
    return Encoder(ToyTokenizer())


def test_loads_a_file_and_a_folder(tmp_path):
    _write(tmp_path / "hotpotqa.jsonl", [_line(), _line(_id="def")])
    _write(tmp_path / "trec_e.jsonl", [_line(dataset=None, input="What is X?\nType:", answers=["Entity"],
                                             all_classes=["Entity", "Location"])])
    one = load_longbench(tmp_path / "hotpotqa.jsonl")
    assert [e.id for e in one] == ["abc", "def"]
    both = load_longbench(tmp_path)
    assert sorted({e.dataset for e in both}) == ["hotpotqa", "trec"]  # "_e" and missing dataset: from the file name
    assert both[0].answers == ("Alice",)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", r"hotpotqa.jsonl:1: not valid JSON"),
        (json.dumps({k: v for k, v in _line().items() if k != "context"}) + "\n", r":1: missing field 'context'"),
        (json.dumps(_line(answers="Alice")) + "\n", r":1: field 'answers' must be list\[str\]"),
        (json.dumps(_line(answers=[])) + "\n", r"field 'answers' is empty"),
        (json.dumps(_line(input=3)) + "\n", r"field 'input' must be str"),
        (json.dumps(_line(length="long")) + "\n", r"field 'length' must be int"),
        (json.dumps(_line(dataset="trec")) + "\n", r"field 'all_classes' must list"),
        (json.dumps(_line(dataset="nosuchset")) + "\n", r"unknown LongBench dataset 'nosuchset'"),
        (json.dumps(_line(dataset="dureader")) + "\n", r"Chinese dataset"),
        (json.dumps(_line()) + "\n[1, 2]\n", r"hotpotqa.jsonl:2: each line must be a JSON object"),
    ],
)
def test_malformed_lines_name_path_line_and_field(tmp_path, content, message):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(LongBenchError, match=message) as info:
        load_longbench(path)
    assert str(path) in str(info.value)


def test_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(LongBenchError, match="no such file or folder") as info:
        load_longbench(tmp_path / "nope.jsonl")
    assert "nope.jsonl" in str(info.value)
    with pytest.raises(LongBenchError, match="no \\*.jsonl files"):
        load_longbench(tmp_path)
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(LongBenchError, match="no examples"):
        load_longbench(tmp_path / "empty.jsonl")


def test_every_dataset_has_a_known_metric():
    from kvlab.metrics import METRICS

    for name, spec in DATASETS.items():
        assert spec.metric in METRICS, name
        assert spec.context.count("{context}") == 1, name
        assert spec.max_new_tokens > 0


def test_middle_truncation_keeps_both_ends():
    ids = tuple(range(10))
    assert middle_truncate(ids, 20) == ids
    assert middle_truncate(ids, 4) == (0, 1, 8, 9)
    assert middle_truncate(ids, 5) == (0, 1, 7, 8, 9)
    assert middle_truncate(ids, 0) == ()


def test_item_segments_and_truncation(tmp_path, enc):
    (ex,) = load_longbench(_write(tmp_path / "hotpotqa.jsonl", [_line()]))
    item = longbench_item(ex, enc, max_length=2000)
    assert item.task == "longbench/hotpotqa" and item.metric == "qa_f1"
    assert not item.meta["truncated"] and item.n_prompt_tokens < 2000
    ctx = enc.tokenizer.decode(item.context_ids)
    assert ctx.startswith("<|im_start|>system") and "Alice wrote the letter to Bob." in ctx
    assert "Who wrote the letter?" in enc.tokenizer.decode(item.question_ids)
    assert enc.tokenizer.decode(item.answer_prefix_ids) == "Answer:"
    assert enc.tokenizer.decode(item.answer_ids) == " Alice"
    short = longbench_item(ex, enc, max_length=300)
    assert short.meta["truncated"] and short.n_prompt_tokens == 300
    # instructions on both sides of the document survive the cut
    text = enc.tokenizer.decode(short.context_ids)
    assert text.startswith("<|im_start|>system") and "Using the passages" not in text  # multi-doc wording
    assert "Answer the question using the passages below" in text
    with pytest.raises(LongBenchError, match="raise the length"):
        longbench_item(ex, enc, max_length=50)


def test_fewshot_and_code_datasets_skip_the_chat_template(tmp_path, enc):
    (ex,) = load_longbench(_write(tmp_path / "lcc.jsonl", [_line(dataset="lcc", input="", answers=["return x"],
                                                               context="def f(x):\n")]))
    item = longbench_item(ex, enc, max_length=500)
    assert "<|im_start|>" not in enc.tokenizer.decode(item.context_ids + item.question_ids)
    assert item.metric == "code_sim" and item.answer_ids == tuple(enc.encode("return x"))
    assert item.score("return x\nmore") == 1.0


def test_file_written_by_the_test_loads_and_scores(tmp_path, enc):
    rows = [
        _line(),
        _line(dataset="trec", input="Where is Rome?\nType:", answers=["Location"],
              all_classes=["Location", "Entity", "Human being"]),
        _line(dataset="passage_count", input="", answers=["3"]),
        _line(dataset="passage_retrieval_en", input="An abstract.", answers=["Paragraph 2"]),
        _line(dataset="gov_report", input="", answers=["The report finds the budget grew."]),
    ]
    _write(tmp_path / "mixed.jsonl", rows)
    items = longbench_items(tmp_path / "mixed.jsonl", enc, max_length=1000)
    by = {it.task: it for it in items}
    assert by["longbench/hotpotqa"].score("alice") == 1.0
    assert by["longbench/trec"].score("Location\nEntity") == 1.0  # first line only
    assert by["longbench/trec"].score("Entity") == 0.0
    assert by["longbench/passage_count"].score("3") == 1.0
    assert by["longbench/passage_retrieval_en"].score("Paragraph 2") == 1.0
    # ROUGE-L: LCS "the report finds" is 3 of 6 tokens on each side -> F = 0.5
    assert by["longbench/gov_report"].score("the budget grew, the report finds") == pytest.approx(0.5)
    assert by["longbench/trec"].metric_kwargs["all_classes"][0] == "Location"
    # selection by dataset and sample count
    only = longbench_items(tmp_path / "mixed.jsonl", enc, max_length=1000, datasets=["trec"], samples=1)
    assert [it.task for it in only] == ["longbench/trec"]
    with pytest.raises(LongBenchError, match="unknown LongBench dataset"):
        longbench_items(tmp_path / "mixed.jsonl", enc, max_length=1000, datasets=["nosuch"])
