"""StepSearch-style step rewards: credit for each search, placed on the token that closes its ``</search>``.

For search ``s`` of a trajectory, with ``sim(d)`` the TF-IDF cosine similarity (scikit-learn) between a
document and the reference text (the gold answers, plus the gold passage when the data has one):

- information gain ``g_s = max(0, max_{d ∈ D_s} sim(d) - max_{d ∈ D_<s} sim(d))`` — how much closer this
  search's documents got to the answer than everything retrieved before (``max`` over nothing = 0);
- redundancy ``u_s = |{d ∈ D_s : d seen in D_<s}| / |D_s|`` — documents already shown (same id, or same
  normalised text);
- step reward ``w_gain · g_s - w_redundancy · u_s``.

The vectorizer is fitted per trajectory on its documents plus the reference, so the IDF weights reflect
what that trajectory saw.
"""

from __future__ import annotations

from collections.abc import Sequence

from zerosim.core.metrics import normalize_answer
from zerosim.core.search import Document


def search_step_rewards(
    searches: Sequence[Sequence[Document]],
    reference: str,
    *,
    gain_weight: float,
    redundancy_weight: float,
) -> list[float]:
    """One reward per search, in order (see the module docstring)."""
    if not searches:
        return []
    sims = _similarities([d.contents for docs in searches for d in docs], reference)
    out, best = [], 0.0
    seen_ids: set[str] = set()
    seen_texts: set[str] = set()
    i = 0
    for docs in searches:
        s = sims[i : i + len(docs)]
        i += len(docs)
        top = max(s, default=0.0)
        gain = max(0.0, top - best)
        best = max(best, top)
        texts = [normalize_answer(d.contents) for d in docs]
        repeated = sum(d.id in seen_ids or t in seen_texts for d, t in zip(docs, texts, strict=True))
        redundancy = repeated / len(docs) if docs else 0.0
        seen_ids.update(d.id for d in docs)
        seen_texts.update(texts)
        out.append(gain_weight * gain - redundancy_weight * redundancy)
    return out


def _similarities(texts: Sequence[str], reference: str) -> list[float]:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.metrics.pairwise import cosine_similarity

    if not reference.strip() or not texts:
        return [0.0] * len(texts)
    vectorizer = TfidfVectorizer(lowercase=True, token_pattern=r"(?u)\b\w+\b")
    try:
        matrix = vectorizer.fit_transform([reference, *texts])
    except ValueError:  # nothing but stop-words / empty vocabulary
        return [0.0] * len(texts)
    return cosine_similarity(matrix[1:], matrix[0]).ravel().tolist()
