"""Quality metrics as pure functions: task scores, fidelity to the full cache, paired statistics.

Task scores follow RULER (string match) and LongBench (QA F1, ROUGE-L, classification, count,
retrieval, code edit similarity); every score is in [0, 1] (reports may multiply by 100). Where a
maintained library exists it is used when installed (``rouge-score`` for ROUGE-L); the fallbacks
here are small and tested against it. Fidelity metrics compare next-token distributions of a
compressed cache with the full cache on the same tokens, so they have signal even where a small
model fails a task.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

from kvlab.intervals import mean_interval

# ---------------------------------------------------------------- RULER string match

_CONTROL = re.compile(r"[\x00-\x1f]")


def _clean(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's recall: the fraction of references found (case-insensitive) in the prediction."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = _clean(prediction).lower()
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_any(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part`` (QA): 1 if any reference is found in the prediction."""
    if not references:
        raise ValueError("string_match_any needs at least one reference")
    pred = _clean(prediction).lower()
    return float(any(ref.lower() in pred for ref in references))


# ---------------------------------------------------------------- LongBench metrics (one gold)

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lowercase, drop punctuation and articles, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def qa_f1(prediction: str, gold: str) -> float:
    """Bag-of-words F1 between normalised prediction and gold."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _rouge_tokens(text: str) -> list[str]:
    # the rouge-score tokenisation: lowercase, alphanumeric runs only
    return re.findall(r"[a-z0-9]+", text.lower())


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a)*len(b)) time, O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l_lcs(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure from an in-house LCS, with rouge-score's tokenisation."""
    pred, ref = _rouge_tokens(prediction), _rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


_ROUGE_SCORER = None


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure: ``rouge-score`` when installed, else :func:`rouge_l_lcs` (same result)."""
    global _ROUGE_SCORER
    if _ROUGE_SCORER is None:
        try:
            from rouge_score import rouge_scorer

            _ROUGE_SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        except ImportError:
            _ROUGE_SCORER = False
    if _ROUGE_SCORER is False:
        return rouge_l_lcs(prediction, reference)
    return float(_ROUGE_SCORER.score(reference, prediction)["rougeL"].fmeasure)


def classification_score(prediction: str, gold: str, all_classes: Sequence[str]) -> float:
    """LongBench TREC scoring: class names found in the prediction, ignoring those that are a
    strict substring of the gold; 1/#matches if the gold is among them."""
    if not all_classes:
        raise ValueError("classification_score needs all_classes (the label set)")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in gold and c != gold)]
    return 1.0 / len(matches) if gold in matches else 0.0


def _integers(text: str) -> list[str]:
    return re.findall(r"\d+", text)


def count_score(prediction: str, gold: str) -> float:
    """LongBench PassageCount: share of the integers in the prediction equal to the gold count."""
    found = _integers(prediction)
    return sum(n == str(gold).strip() for n in found) / len(found) if found else 0.0


def retrieval_score(prediction: str, gold: str) -> float:
    """LongBench PassageRetrieval: the gold is "Paragraph N"; share of integers in the prediction
    equal to N."""
    ids = _integers(gold)
    if not ids:
        raise ValueError(f"retrieval gold {gold!r} has no paragraph number (expected 'Paragraph N')")
    found = _integers(prediction)
    return sum(n == ids[0] for n in found) / len(found) if found else 0.0


def indel_similarity(a: str, b: str) -> float:
    """Normalised indel similarity 2*LCS/(|a|+|b|): the quantity ``fuzz.ratio`` reports /100."""
    if not a and not b:
        return 1.0
    return 2 * lcs_length(a, b) / (len(a) + len(b))


def code_sim_score(prediction: str, gold: str) -> float:
    """LongBench LCC / RepoBench-P: similarity of the first code-looking line of the prediction
    (no backtick, ``#`` or ``//``) to the gold line."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n")
                 if "`" not in ln and "#" not in ln and "//" not in ln), "")
    return indel_similarity(line, gold)


# ---------------------------------------------------------------- one registry for all scores


def _best(metric: Callable[..., float]) -> Callable[..., float]:
    def over_answers(prediction: str, references: Sequence[str], **kw) -> float:
        if not references:
            raise ValueError(f"{metric.__name__} needs at least one gold answer")
        return max(metric(prediction, ref, **kw) for ref in references)

    over_answers.__name__ = metric.__name__
    return over_answers


# name -> f(prediction, references, **kwargs) -> float in [0, 1]; LongBench metrics take the
# best over the gold answers, as LongBench does.
METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_any": string_match_any,
    "qa_f1": _best(qa_f1),
    "rouge_l": _best(rouge_l),
    "classification": _best(classification_score),
    "count": _best(count_score),
    "retrieval": _best(retrieval_score),
    "code_sim": _best(code_sim_score),
}


def score_prediction(metric: str, prediction: str, references: Sequence[str], **kwargs) -> float:
    """Score one prediction with the named metric."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; metrics: {', '.join(METRICS)}")
    return float(METRICS[metric](prediction, references, **kwargs))


# ---------------------------------------------------------------- fidelity to the full cache


def answer_span_fidelity(logits, answer_ids: Sequence[int], ref_logits=None,
                         first_index: int = 0) -> dict[str, float | None]:
    """Teacher-forced metrics on a gold answer span.

    ``logits[t]`` (shape [T, V]) is the compressed run's prediction for ``answer_ids[t]``;
    ``ref_logits`` the full cache's on the same tokens. Returns the gold NLL (summed nats),
    first-answer-token accuracy and top-2 logit margin at ``first_index`` (the first token that
    carries content: once it is right, later sub-tokens are easy), per-token accuracy, and, given
    a reference, KL(full || compressed) in nats per token and top-1 agreement over the span.
    """
    import torch

    logq = torch.log_softmax(logits.float(), dim=-1)
    gold = torch.as_tensor(list(answer_ids), dtype=torch.long, device=logq.device)
    if logq.ndim != 2 or logq.shape[0] != gold.numel() or gold.numel() == 0:
        raise ValueError(f"logits {tuple(logq.shape)} do not match {gold.numel()} answer tokens")
    if not 0 <= first_index < gold.numel():
        raise ValueError(f"first_index {first_index} is outside the {gold.numel()} answer tokens")
    top_q = logq.argmax(-1)
    top2 = logits[first_index].float().topk(min(2, logits.shape[-1])).values
    out: dict[str, float | None] = {
        "gold_nll": float(-logq.gather(1, gold[:, None]).sum()),
        "first_token_acc": float(top_q[first_index] == gold[first_index]),
        "first_margin": float(top2[0] - top2[-1]),
        "tf_token_acc": float((top_q == gold).float().mean()),
        "kl": None,
        "top1_agree": None,
    }
    if ref_logits is not None:
        logp = torch.log_softmax(ref_logits.float().to(logq.device), dim=-1)
        if logp.shape != logq.shape:
            raise ValueError(f"reference logits {tuple(logp.shape)} differ from {tuple(logq.shape)}")
        out["kl"] = float(kl_per_position(logp, logq).mean())
        out["top1_agree"] = float((logp.argmax(-1) == top_q).float().mean())
    return out


def kl_per_position(logp, logq):
    """KL(p || q) per row from log-probabilities (nats), clamped at 0 against round-off."""
    return (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)


def mean_token_nll(logits, target_ids: Sequence[int]) -> float:
    """Mean negative log-likelihood (nats per token) of ``target_ids`` under ``logits`` [T, V]."""
    import torch

    logq = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(list(target_ids), dtype=torch.long, device=logq.device)
    if logq.shape[0] != target.numel() or target.numel() == 0:
        raise ValueError(f"logits {tuple(logq.shape)} do not match {target.numel()} target tokens")
    return float(-logq.gather(1, target[:, None]).mean())


def context_utility(nll_none: float, nll_compressed: float, nll_full: float) -> float:
    """"Context utility retained" U = (NLL_none - NLL_compressed) / (NLL_none - NLL_full), with
    mean NLLs (= log perplexities): 1 when compression loses nothing, 0 when the compressed
    context helps no more than no context. NaN when the full context does not help at all."""
    gain = nll_none - nll_full
    if not gain > 0:
        return math.nan
    return (nll_none - nll_compressed) / gain


# ---------------------------------------------------------------- paired statistics


def paired_difference(method: Sequence[float], baseline: Sequence[float], n_boot: int = 2000,
                      ci: float = 0.95, seed: int = 0, interval: str = "auto") -> dict[str, float]:
    """Mean of (method - baseline) over paired items, with a t-interval of the differences
    (:func:`kvlab.intervals.mean_interval`: none below 3 pairs). Pairs with a missing value on either
    side are dropped; ``n_boot`` and ``seed`` serve ``interval='bca'``."""
    if len(method) != len(baseline):
        raise ValueError(f"paired samples differ in length: {len(method)} vs {len(baseline)}")
    diffs = [m - b for m, b in zip(method, baseline, strict=True)
             if m is not None and b is not None and not (math.isnan(m) or math.isnan(b))]
    mean, lo, hi = mean_interval(diffs, level=ci, method=interval, n_boot=n_boot, seed=seed).as_tuple()
    return {"diff": mean, "diff_lo": lo, "diff_hi": hi, "n_pairs": len(diffs)}
