"""QA answer metrics: the one implementation shared by training rewards and evaluation.

All scores follow SQuAD conventions: strings are compared after :func:`normalize_answer`, and a prediction
is scored against every gold answer, keeping the best score. An empty prediction (empty after
normalisation) scores 0 under every metric, so "say nothing" is never rewarded.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop articles a/an/the, collapse whitespace.

    >>> normalize_answer("The  Republic of Peru!")
    'republic of peru'
    """
    s = s.lower().translate(_PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _normalized_golds(golds: str | Iterable[str]) -> list[str]:
    """Normalise the gold answers (a single string counts as one gold); golds empty after it are dropped."""
    if isinstance(golds, str):
        golds = [golds]
    return [g for g in (normalize_answer(x) for x in golds) if g]


def exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0."""
    p = normalize_answer(pred)
    return float(bool(p) and p in _normalized_golds(golds))


def cover_exact_match(pred: str, golds: str | Iterable[str]) -> float:
    """1.0 if some normalised gold answer is a substring of the normalised prediction, else 0.0.

    This is FlashRAG's ``acc`` / Search-R1's ``subem``: it forgives extra words around the answer
    ("It is Lima, Peru" covers "Lima"). Plain substring, not token-aligned, as in those projects.
    """
    p = normalize_answer(pred)
    return float(bool(p) and any(g in p for g in _normalized_golds(golds)))


def f1_score(pred: str, golds: str | Iterable[str]) -> float:
    """Best token-level F1 between the normalised prediction and any normalised gold answer.

    For one gold: with ``c`` the number of tokens shared (counted with multiplicity),
    ``precision = c / len(pred_tokens)``, ``recall = c / len(gold_tokens)``,
    ``F1 = 2 * precision * recall / (precision + recall)``, and 0 when ``c == 0``.
    """
    pred_tokens = normalize_answer(pred).split()
    if not pred_tokens:
        return 0.0
    best = 0.0
    for gold in _normalized_golds(golds):
        gold_tokens = gold.split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision = common / len(pred_tokens)
        recall = common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def answer_in_text(text: str, golds: str | Iterable[str]) -> bool:
    """True if some normalised gold answer occurs in the normalised ``text`` as whole words.

    Token-aligned (unlike :func:`cover_exact_match`), so the gold "5" is not found in "1995" nor "art" in
    "party". This is the one containment test for documents: evaluation recall (``recall@k``,
    ``val/recall``), simulator SFT labels, the simulator's ``on_leak`` check, corpus negatives, the warm
    start and the simulator quality report all use it.
    """
    padded = f" {normalize_answer(text)} "
    return any(f" {g} " in padded for g in _normalized_golds(golds))
