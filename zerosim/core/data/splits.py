"""The embedded factbook's split names (nothing here imports the loaders: the spec parser and the loaders read it).

train/dev/test: by question (a test question may share a fact with a training one); fact-train/fact-test: by
country, no fact shared (:mod:`zerosim.core.data.factbook`).
"""

from __future__ import annotations

BUILT_SPLITS = ("train", "dev", "test", "fact-train", "fact-test")  # the files the builder writes
# Read from fact-train, split by a hash of the country code (like fact-train/fact-test): fact-dev, ~12% of its
# countries (215 questions on 19 countries), for choosing a recipe without touching fact-test; fact-tune, the rest,
# to train on while fact-dev judges. No country, so no fact, is shared between fact-tune, fact-dev and fact-test.
DERIVED_SPLITS = {"fact-dev": ("fact-train", True), "fact-tune": ("fact-train", False)}
DEV_PERCENT = 12
SPLITS = (*BUILT_SPLITS, *DERIVED_SPLITS)


def in_fact_dev(question_id: str) -> bool:
    """Whether a fact-train question (id ``{code}-{kind}``) is in fact-dev: its country's hash bucket."""
    import hashlib

    code = question_id.split("-")[0]
    return int(hashlib.sha256(f"fact-dev:{code}".encode()).hexdigest()[:8], 16) % 100 < DEV_PERCENT
