"""How much of its question a search query carries: the gate on the simulator's answer hint in training.

A training-time simulator sees the question and its gold answers, so it can write documents that hold the
answer whatever the query says. A policy then learns that the query does not matter (the CPU experiment's
curriculum arm came to search ``what`` for every question, docs/experiments.md). With
``search.simulator.hint_min_coverage`` set, a request whose query covers less than that share of its
question's content words is written from the query alone, as at evaluation: a query that says nothing
about the question gets documents about what it does say, as from a real engine.

Content words: lower-cased word tokens, without English stopwords and question words (bm25s's extended
list plus "whose"/"whom"), Snowball-stemmed (the stemmer the BM25 retriever uses).
"""

from __future__ import annotations

import re
from functools import lru_cache

from bm25s.stopwords import STOPWORDS_EN_PLUS

STOPWORDS = frozenset(STOPWORDS_EN_PLUS) | {"whose", "whom"}
_WORD = re.compile(r"\w+")


@lru_cache(maxsize=1)
def _stemmer():
    import Stemmer

    return Stemmer.Stemmer("english")


def content_words(text: str) -> frozenset[str]:
    """The stemmed content words of ``text``."""
    words = [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]
    return frozenset(_stemmer().stemWords(words))


def question_coverage(query: str, question: str) -> float:
    """The share of ``question``'s content words that ``query`` contains (1.0 for a question without any)."""
    wanted = content_words(question)
    if not wanted:
        return 1.0
    return len(wanted & content_words(query)) / len(wanted)
