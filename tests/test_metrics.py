"""QA metrics: SQuAD normalisation, exact match, token F1, cover exact match."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerosim.core.metrics import cover_exact_match, exact_match, f1_score, normalize_answer


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("Lima", "lima"),
        ("The Republic of Peru!", "republic of peru"),
        ("  a   cat  in an  hat ", "cat in hat"),
        ("Washington, D.C.", "washington dc"),  # punctuation is deleted, not turned into spaces
        ("Banana theory", "banana theory"),  # articles only as whole words
        ("THE", ""),
        ("", ""),
        ("San José", "san josé"),  # non-ASCII letters are kept
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_match_ignores_case_punctuation_and_articles():
    assert exact_match("the LIMA.", ["Lima"]) == 1.0
    assert exact_match("An apple", "apple") == 1.0  # a single gold string is accepted
    assert exact_match("Lima, Peru", ["Lima"]) == 0.0


def test_exact_match_takes_best_gold():
    assert exact_match("nuevo sol", ["sol", "Nuevo Sol"]) == 1.0
    assert exact_match("soles", ["sol", "nuevo sol"]) == 0.0
    assert exact_match("Lima", []) == 0.0


@pytest.mark.parametrize("metric", [exact_match, f1_score, cover_exact_match])
@pytest.mark.parametrize("pred", ["", "   ", "the", "?!"])
def test_empty_prediction_scores_zero(metric, pred):
    # "the" normalises to "" too, and so does the gold "a": an empty answer must never match
    assert metric(pred, ["Lima", "a"]) == 0.0


def test_f1_partial_overlap_by_hand():
    # pred tokens [capital, is, lima] ("the" dropped), gold [lima]: P = 1/3, R = 1, F1 = 2*(1/3)/(4/3) = 0.5
    assert f1_score("The capital is Lima", ["Lima"]) == pytest.approx(0.5)
    # pred [nuevo, sol, coins], gold [nuevo, sol]: P = 2/3, R = 1, F1 = (4/3)/(5/3) = 0.8
    assert f1_score("nuevo sol coins", "nuevo sol") == pytest.approx(0.8)
    # repeated tokens count once each side: pred [lima, lima], gold [lima]: P = 1/2, R = 1, F1 = 2/3
    assert f1_score("Lima Lima", ["Lima"]) == pytest.approx(2 / 3)
    # pred [red, and, white], gold [red, white, blue]: c = 2, P = 2/3, R = 2/3, F1 = 2/3
    assert f1_score("red and white", ["red, white, blue"]) == pytest.approx(2 / 3)


def test_f1_takes_best_gold_and_is_zero_without_overlap():
    assert f1_score("nuevo sol", ["sol", "nuevo sol"]) == 1.0
    assert f1_score("nuevo sol", ["sol"]) == pytest.approx(2 / 3)
    assert f1_score("Quito", ["Lima"]) == 0.0


def test_cover_exact_match():
    assert cover_exact_match("It is Lima, the capital of Peru.", ["Lima"]) == 1.0
    assert cover_exact_match("Lima", ["Lima, Peru"]) == 0.0  # the gold must fit inside the prediction
    assert cover_exact_match("The answer: Washington D.C.", ["Washington, D.C."]) == 1.0
    assert cover_exact_match("Quito", ["Lima", "quito"]) == 1.0
    # plain substring after normalisation, as in FlashRAG / Search-R1: not token-aligned
    assert cover_exact_match("Limassol", ["Lima"]) == 1.0


answers = st.text(alphabet=st.sampled_from("abc ,.Thé"), max_size=12)


@given(pred=answers, golds=st.lists(answers, max_size=3))
def test_metric_relations(pred, golds):
    em, f1, cover = exact_match(pred, golds), f1_score(pred, golds), cover_exact_match(pred, golds)
    assert all(0.0 <= x <= 1.0 for x in (em, f1, cover))
    if em:
        assert f1 == 1.0 and cover == 1.0
    if not normalize_answer(pred):
        assert em == f1 == cover == 0.0
