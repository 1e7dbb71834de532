"""Pure metric functions: RULER string match, LongBench metrics, fidelity, paired differences."""

import math
import random

import pytest
import torch

from kvlab import metrics as M


def test_string_match_all_is_case_insensitive_recall():
    refs = ["1234567", "ABC"]
    assert M.string_match_all("the numbers are 1234567 and abc.", refs) == 1.0
    assert M.string_match_all("1234567 only", refs) == 0.5
    assert M.string_match_all("", refs) == 0.0
    # extra output is not penalised; control characters do not hide a match
    assert M.string_match_all("blah\x00 1234567 blah blah", ["1234567"]) == 1.0


def test_string_match_any():
    assert M.string_match_any("Paris is the capital", ["paris", "Lyon"]) == 1.0
    assert M.string_match_any("Rome", ["paris", "Lyon"]) == 0.0
    with pytest.raises(ValueError):
        M.string_match_any("x", [])


def test_qa_f1_normalises_and_counts_overlap():
    assert M.normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert M.qa_f1("The Eiffel Tower", "eiffel tower") == 1.0
    # pred: {eiffel, tower, in, paris} vs gold {eiffel, tower}: P=2/4, R=1 -> F1=2/3
    assert M.qa_f1("Eiffel tower in Paris", "the Eiffel Tower") == pytest.approx(2 / 3)
    assert M.qa_f1("nothing", "eiffel tower") == 0.0
    assert M.qa_f1("", "x") == 0.0
    # repeated words count once per occurrence on both sides
    assert M.qa_f1("x b b", "b b c") == pytest.approx(2 / 3)
    assert M.qa_f1("a b b", "b b c") == pytest.approx(0.8)  # the article "a" is dropped


def test_lcs_length_known_values():
    assert M.lcs_length("ABCBDAB", "BDCABA") == 4
    assert M.lcs_length("", "abc") == 0
    assert M.lcs_length(["a", "b", "c"], ["a", "c"]) == 2


def test_rouge_l_fallback_by_hand():
    # pred 4 tokens, ref 6 tokens, LCS "the cat on mat" -> P=1, R=4/6, F=0.8
    assert M.rouge_l_lcs("The cat, on mat!", "the cat sat on the mat") == pytest.approx(0.8)
    assert M.rouge_l_lcs("", "a b") == 0.0
    assert M.rouge_l_lcs("x y", "a b") == 0.0


def test_rouge_l_agrees_with_rouge_score():
    pytest.importorskip("rouge_score")
    rng = random.Random(0)
    vocab = "alpha beta gamma delta the a of cat mat sat on 42 x".split()
    for _ in range(60):
        pred = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        ref = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 12)))
        assert M.rouge_l(pred, ref) == pytest.approx(M.rouge_l_lcs(pred, ref))


def test_classification_score():
    classes = ["Location", "Abbreviation", "Description", "Description of a person"]
    assert M.classification_score("Type: Location", "Location", classes) == 1.0
    # two classes matched, gold among them -> 1/2
    assert M.classification_score("Location or Abbreviation", "Location", classes) == 0.5
    # a match that is a strict substring of the gold is ignored
    assert M.classification_score("Description of a person", "Description of a person", classes) == 1.0
    assert M.classification_score("Abbreviation", "Location", classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        M.classification_score("x", "y", [])


def test_count_and_retrieval_scores():
    assert M.count_score("There are 7 unique paragraphs", "7") == 1.0
    assert M.count_score("7 or 8", "7") == 0.5
    assert M.count_score("none", "7") == 0.0
    assert M.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert M.retrieval_score("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5
    assert M.retrieval_score("I do not know", "Paragraph 12") == 0.0
    with pytest.raises(ValueError, match="Paragraph N"):
        M.retrieval_score("1", "no number")


def test_indel_similarity_matches_fuzz_ratio_definition():
    # fuzz.ratio("this is a test", "this is a test!") == 97 (2*14/29 = 0.9655)
    assert M.indel_similarity("this is a test", "this is a test!") == pytest.approx(28 / 29)
    assert M.indel_similarity("abc", "abc") == 1.0
    assert M.indel_similarity("abc", "xyz") == 0.0
    assert M.indel_similarity("", "") == 1.0


def test_code_sim_takes_first_code_line():
    gold = "x = foo(a, b)"
    pred = "```python\n# compute x\nx = foo(a, b)\nprint(x)"
    assert M.code_sim_score(pred, gold) == 1.0
    assert 0 < M.code_sim_score("y = foo(a)", gold) < 1


def test_registry_takes_best_over_answers():
    assert M.score_prediction("qa_f1", "Paris", ["London", "paris"]) == 1.0
    assert M.score_prediction("classification", "Location", ["Location"],
                              all_classes=["Location", "Entity"]) == 1.0
    with pytest.raises(ValueError, match="unknown metric"):
        M.score_prediction("bleu", "x", ["y"])
    with pytest.raises(ValueError, match="gold answer"):
        M.score_prediction("qa_f1", "x", [])


def test_answer_span_fidelity_identical_and_shifted():
    torch.manual_seed(0)
    logits = torch.randn(3, 11)
    gold = logits.argmax(-1).tolist()
    same = M.answer_span_fidelity(logits, gold, logits)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6)
    assert same["top1_agree"] == 1.0 and same["first_token_acc"] == 1.0 and same["tf_token_acc"] == 1.0
    expected_nll = float(-torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(gold)].sum())
    assert same["gold_nll"] == pytest.approx(expected_nll)

    other = logits.clone()
    other[0] = -other[0]  # flip the first distribution
    diff = M.answer_span_fidelity(other, gold, logits)
    assert diff["first_token_acc"] == 0.0
    assert diff["top1_agree"] == pytest.approx(2 / 3)
    p = torch.softmax(logits[0], -1)
    kl0 = float((p * (p.log() - torch.log_softmax(other[0], -1))).sum())
    assert diff["kl"] == pytest.approx(kl0 / 3, rel=1e-5)
    assert diff["gold_nll"] > same["gold_nll"]
    # first-token accuracy and margin at a later content token (after a lone space token)
    shifted = M.answer_span_fidelity(other, gold, logits, first_index=1)
    assert shifted["first_token_acc"] == 1.0
    top = other[1].topk(2).values
    assert shifted["first_margin"] == pytest.approx(float(top[0] - top[1]))
    with pytest.raises(ValueError, match="first_index"):
        M.answer_span_fidelity(other, gold, logits, first_index=3)
    # no reference: KL and agreement are unknown, not zero
    assert M.answer_span_fidelity(logits, gold)["kl"] is None
    with pytest.raises(ValueError, match="answer tokens"):
        M.answer_span_fidelity(logits, gold[:2])


def test_mean_token_nll_and_context_utility():
    logits = torch.zeros(4, 8)  # uniform
    assert M.mean_token_nll(logits, [0, 1, 2, 3]) == pytest.approx(math.log(8))
    assert M.context_utility(3.0, 2.0, 2.0) == 1.0
    assert M.context_utility(3.0, 3.0, 2.0) == 0.0
    assert M.context_utility(3.0, 2.5, 2.0) == pytest.approx(0.5)
    assert math.isnan(M.context_utility(2.0, 2.0, 2.5))


def test_paired_difference_uses_pairing():
    rng = random.Random(2)
    base = [rng.random() for _ in range(50)]
    method = [b - 0.1 + rng.gauss(0, 0.01) for b in base]  # tiny noise around a shift of -0.1
    d = M.paired_difference(method, base, seed=0)
    assert d["n_pairs"] == 50
    assert d["diff"] == pytest.approx(-0.1, abs=0.01)
    # paired: the CI is as narrow as the noise, far narrower than the spread of the scores
    assert d["diff_hi"] - d["diff_lo"] < 0.02 and d["diff_hi"] < 0
    d2 = M.paired_difference([1.0, None, float("nan")], [0.0, 1.0, 1.0])
    assert d2["n_pairs"] == 1 and d2["diff"] == 1.0 and math.isnan(d2["diff_lo"])
    d3 = M.paired_difference([1.0, 2.0], [0.0, 0.5])  # two pairs: no interval
    assert d3["diff"] == 1.25 and math.isnan(d3["diff_lo"]) and math.isnan(d3["diff_hi"])
    with pytest.raises(ValueError, match="length"):
        M.paired_difference([1.0], [1.0, 2.0])
