"""LongBench-format files a user already has: load, validate, render prompts, pick the metric.

kvlab never downloads LongBench. A user points at a ``{dataset}.jsonl`` file (or a folder of them)
from LongBench's data archive; every line is an object with ``input``, ``context``, ``answers``
and, where present, ``all_classes``, ``dataset``, ``length``, ``_id``. Each dataset gets kvlab's
paraphrase of the LongBench prompt, split the kvpress way into a context part (instruction plus
document: what a policy compresses), a question part and an answer prefix, plus LongBench's metric
and generation budget. Over-long documents are cut in the middle, keeping both ends, as
LongBench's ``pred.py`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvlab.tasks.prompt import ChatFrame, Encoder, TaskError, TaskItem, content_start, item_seed


class LongBenchError(TaskError):
    """A missing or malformed LongBench file; the message names the path, line and field."""


@dataclass(frozen=True)
class DatasetSpec:
    """How one LongBench dataset is prompted and scored."""

    context: str          # template with {context}: instruction + document (compressed)
    question: str         # template with {input}
    answer_prefix: str
    metric: str           # a name in kvlab.metrics.METRICS
    max_new_tokens: int   # LongBench's budget
    chat: bool = True     # LongBench skips the chat template for few-shot and code tasks
    first_line: bool = False  # score only the first line of the prediction


def _qa(what: str, label: str, extra: str = "") -> tuple[str, str]:
    intro = (f"Read the {what} below and answer the question that follows as briefly as possible, "
             f"with a short phrase if you can and no explanation.{extra}\n\n")
    return (intro + f"{label}: {{context}}\n\n"
            f"Using the {what} above, answer the question briefly, without explanation.{extra}\n\n",
            "Question: {input}\n\n")


def _multidoc() -> tuple[str, str]:
    rule = "Answer the question using the passages below. Give only the answer, with no other words."
    return (f"{rule}\n\nThe passages:\n{{context}}\n\n{rule}\n\n", "Question: {input}\n")


_QASPER_RULE = (" If the article does not contain the answer, write \"unanswerable\"; for a yes/no "
                "question, write \"yes\", \"no\" or \"unanswerable\".")

DATASETS: dict[str, DatasetSpec] = {
    "narrativeqa": DatasetSpec(*_qa("story", "Story"), "Answer:", "qa_f1", 128),
    "qasper": DatasetSpec(*_qa("scientific article", "Article", _QASPER_RULE), "Answer:", "qa_f1", 128),
    "multifieldqa_en": DatasetSpec(*_qa("text", "Text"), "Answer:", "qa_f1", 64),
    "hotpotqa": DatasetSpec(*_multidoc(), "Answer:", "qa_f1", 32),
    "2wikimqa": DatasetSpec(*_multidoc(), "Answer:", "qa_f1", 32),
    "musique": DatasetSpec(*_multidoc(), "Answer:", "qa_f1", 32),
    "gov_report": DatasetSpec(
        "Below is a report from a government agency. Write a one-page summary of it.\n\n"
        "Report:\n{context}\n\nNow write a one-page summary of the report.\n\n",
        "{input}", "Summary:", "rouge_l", 512),
    "qmsum": DatasetSpec(
        "Below is a meeting transcript, followed by a query about it. Answer the query in one or "
        "more sentences.\n\nTranscript:\n{context}\n\nNow answer the query in one or more sentences.\n\n",
        "Query: {input}\n", "Answer:", "rouge_l", 512),
    "multi_news": DatasetSpec(
        "Below are several news articles. Write a one-page summary of all of them.\n\n"
        "News:\n{context}\n\nNow write a one-page summary of all the news.\n\n",
        "{input}", "Summary:", "rouge_l", 512),
    "trec": DatasetSpec(
        "Classify the type of each question below. Examples of questions with their types:\n"
        "{context}\n", "{input}", "", "classification", 64, chat=False, first_line=True),
    "triviaqa": DatasetSpec(
        "Answer the question from the given passage, with only the answer. Examples follow.\n\n"
        "{context}\n\n", "{input}", "", "qa_f1", 32, chat=False, first_line=True),
    "samsum": DatasetSpec(
        "Summarize the dialogue into a few short sentences. Examples follow.\n\n{context}\n\n",
        "{input}", "", "rouge_l", 128, chat=False, first_line=True),
    "passage_count": DatasetSpec(
        "Below are several paragraphs, some of which may repeat. Read them all and work out how "
        "many are unique (different from each other).\n\n{context}\n\n",
        "Give the number of unique paragraphs as a number only, such as 1, 2 or 3, with nothing else.\n\n",
        "The final answer is: ", "count", 32),
    "passage_retrieval_en": DatasetSpec(
        "Below are 30 paragraphs from Wikipedia and one abstract. Find the paragraph the abstract "
        "was written from.\n\n{context}\n\n",
        "The abstract:\n\n{input}\n\nGive the number of that paragraph, in the form \"Paragraph 1\", "
        "\"Paragraph 2\" and so on.\n\n",
        "The answer is: ", "retrieval", 32),
    "lcc": DatasetSpec("Complete the code given below.\n{context}", "", "Next line of code:\n",
                       "code_sim", 64, chat=False),
    "repobench-p": DatasetSpec("Complete the code given below.\n{context}", "{input}",
                               "Next line of code:\n", "code_sim", 64, chat=False),
}
_CHINESE = {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}


@dataclass(frozen=True)
class LongBenchExample:
    """One validated line of a LongBench file; ``where`` is ``path:line`` for error messages."""

    dataset: str
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...] | None
    length: int | None
    id: str
    where: str


def dataset_key(name: str) -> str:
    """``hotpotqa_e`` -> ``hotpotqa``: LongBench-E files share the dataset's prompt and metric."""
    return name[:-2] if name.endswith("_e") else name


def _spec(dataset: str, where: str) -> DatasetSpec:
    key = dataset_key(dataset)
    if key in DATASETS:
        return DATASETS[key]
    if key in _CHINESE:
        raise LongBenchError(f"{where}: Chinese dataset {dataset!r} is not supported (its metrics need jieba); "
                             f"use the English datasets: {', '.join(DATASETS)}")
    raise LongBenchError(f"{where}: unknown LongBench dataset {dataset!r}; known: {', '.join(DATASETS)}")


def _field(obj: dict, name: str, where: str, kind: str, required: bool = True):
    if name not in obj or obj[name] is None:
        if required:
            raise LongBenchError(f"{where}: missing field {name!r} (each line needs input, context, answers)")
        return None
    value = obj[name]
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
    }[kind]
    if not ok:
        raise LongBenchError(f"{where}: field {name!r} must be {kind}, got {type(value).__name__}: {value!r:.60}")
    return value


def parse_example(obj, where: str, default_dataset: str | None = None) -> LongBenchExample:
    """Validate one decoded JSON line."""
    if not isinstance(obj, dict):
        raise LongBenchError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    dataset = _field(obj, "dataset", where, "str", required=default_dataset is None) or default_dataset
    answers = _field(obj, "answers", where, "list[str]")
    if not answers:
        raise LongBenchError(f"{where}: field 'answers' is empty; it needs at least one gold answer")
    spec = _spec(dataset, where)
    classes = _field(obj, "all_classes", where, "list[str]", required=False)
    if spec.metric == "classification" and not classes:
        raise LongBenchError(f"{where}: dataset {dataset!r} is scored by class, so field 'all_classes' "
                             f"must list the labels")
    return LongBenchExample(
        dataset=dataset_key(dataset),
        input=_field(obj, "input", where, "str"),
        context=_field(obj, "context", where, "str"),
        answers=tuple(answers),
        all_classes=tuple(classes) if classes else None,
        length=_field(obj, "length", where, "int", required=False),
        id=str(obj.get("_id", where)),
        where=where,
    )


def load_longbench(path: str | Path) -> list[LongBenchExample]:
    """Read a LongBench jsonl file, or every ``*.jsonl`` in a folder (sorted by name).

    A line without ``dataset`` takes it from the file name (``hotpotqa_e.jsonl`` -> hotpotqa).
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise LongBenchError(f"{path}: no *.jsonl files in this folder; pass LongBench's data/{{dataset}}.jsonl")
    elif path.is_file():
        files = [path]
    else:
        raise LongBenchError(f"{path}: no such file or folder; pass a LongBench jsonl file or a folder of them "
                             f"(kvlab never downloads datasets)")
    examples: list[LongBenchExample] = []
    for file in files:
        stem_dataset = dataset_key(file.stem)
        with open(file, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    raise LongBenchError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
                examples.append(parse_example(obj, where, default_dataset=stem_dataset))
    if not examples:
        raise LongBenchError(f"{path}: no examples found (the file is empty)")
    return examples


def _split_template(template: str, slot: str) -> tuple[str, str]:
    before, _, after = template.partition(slot)
    return before, after


def middle_truncate(ids: tuple[int, ...], keep: int) -> tuple[int, ...]:
    """Keep the first and last halves of ``keep`` tokens (LongBench's truncation)."""
    if keep <= 0:
        return ()
    if len(ids) <= keep:
        return ids
    head = keep // 2
    return ids[:head] + ids[len(ids) - (keep - head):]


def longbench_item(example: LongBenchExample, enc: Encoder, max_length: int, sample: int = 0,
                   max_new_tokens: int | None = None, base_seed: int = 0) -> TaskItem:
    """Render one example as a :class:`TaskItem` of at most ``max_length`` prompt tokens (the
    document is cut in the middle when needed). Few-shot and code datasets skip the chat
    template, as LongBench does."""
    spec = DATASETS[example.dataset]
    frame = enc.frame if (spec.chat and enc.frame.templated) else ChatFrame(head="", tail="", templated=False)
    before, after = _split_template(spec.context, "{context}")
    head_ids = enc.encode(frame.head + before)
    doc_ids = enc.encode(example.context)
    tail_ids = enc.encode(after) if after else ()
    question_ids = enc.encode(spec.question.format(input=example.input) + frame.tail)
    prefix_ids = enc.encode(spec.answer_prefix) if spec.answer_prefix else ()
    fixed = len(head_ids) + len(tail_ids) + len(question_ids) + len(prefix_ids)
    if fixed >= max_length:
        raise LongBenchError(f"{example.where}: the prompt without the document already takes {fixed} tokens, "
                             f"more than max_length {max_length}; raise the length")
    doc_kept = middle_truncate(doc_ids, max_length - fixed)
    sep = "" if spec.answer_prefix.endswith((" ", "\n")) or not spec.answer_prefix else " "
    answer_ids = enc.encode(sep + example.answers[0])
    return TaskItem(
        task=f"longbench/{example.dataset}",
        length=int(max_length),
        depth=None,
        sample=sample,
        seed=item_seed(base_seed, example.dataset, max_length, None, sample),
        context_ids=head_ids + doc_kept + tail_ids,
        question_ids=question_ids,
        answer_prefix_ids=prefix_ids,
        answer_ids=answer_ids,
        answer_start=content_start(enc, answer_ids),
        references=example.answers,
        metric=spec.metric,
        max_new_tokens=int(max_new_tokens or spec.max_new_tokens),
        metric_kwargs={"all_classes": list(example.all_classes)} if spec.metric == "classification" else {},
        first_line_only=spec.first_line,
        meta={"id": example.id, "where": example.where, "document_tokens": len(doc_ids),
              "truncated": len(doc_kept) < len(doc_ids)},
    )


def longbench_items(path: str | Path, tokenizer, max_length: int, samples: int | None = None,
                    datasets: list[str] | None = None, max_new_tokens: int | None = None) -> list[TaskItem]:
    """Load a file or folder and render the first ``samples`` examples of each dataset."""
    enc = tokenizer if isinstance(tokenizer, Encoder) else Encoder(tokenizer)
    wanted = {dataset_key(d) for d in datasets} if datasets else None
    if wanted:
        unknown = wanted - set(DATASETS)
        if unknown:
            raise LongBenchError(f"unknown LongBench dataset(s) {sorted(unknown)}; known: {', '.join(DATASETS)}")
    counts: dict[str, int] = {}
    items = []
    for ex in load_longbench(path):
        if wanted and ex.dataset not in wanted:
            continue
        k = counts.get(ex.dataset, 0)
        if samples is not None and k >= samples:
            continue
        counts[ex.dataset] = k + 1
        items.append(longbench_item(ex, enc, max_length, sample=k, max_new_tokens=max_new_tokens))
    if not items:
        raise LongBenchError(f"{path}: no examples of the requested datasets {sorted(wanted or [])}")
    return items
