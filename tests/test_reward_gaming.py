"""A reward one answer cannot game (issue: runs fell onto "parliamentary republic" and "Paris").

Measured on the embedded corpus and questions with the real BM25 retriever: a policy that copies from its documents
(the gold answer when its top document holds it, else that document's first words) against one that gives one
answer to every question (the most common gold answer of the questions asked). Under each shipped recipe's reward
the constant answer must earn less overall, and — what GRPO's group-relative advantage reads — no more than the
copier on the questions both get wrong: a wrong answer that is paid more than another wrong answer pulls every
group toward it. F1 pays "presidential republic" ~0.5 on every other government type; EM pays a wrong answer
nothing, whichever it is.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from zerosim.agent.rewards import make_reward_func
from zerosim.core.data.embedded import load_questions
from zerosim.core.metrics import exact_match, normalize_answer
from zerosim.core.search import SearchRequest
from zerosim.engines import real_retriever
from zerosim.training.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["configs/demo.yaml", "configs/demo-learning.yaml"]


@pytest.fixture(scope="module")
def government_questions():
    """The fact-train questions about government types (where one answer covers ~half of them), each with its
    top BM25 document."""
    questions = [
        q for q in load_questions("factbook", "fact-train") if q.metadata.get("kind") == "government_type"
    ]
    retriever = real_retriever("bm25", "factbook", None)
    top = retriever.search([SearchRequest(query=q.question) for q in questions], 1)
    return questions, [docs[0].contents for docs in top]


def _copier(question, document: str) -> str:
    text = normalize_answer(document)
    for gold in question.golden_answers:
        if normalize_answer(gold) and normalize_answer(gold) in text:
            return gold
    return " ".join(document.split()[:3])


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_constant_answer_earns_less_than_copying_from_the_documents(recipe, government_questions):
    questions, documents = government_questions
    r = load_train_config(ROOT / recipe).reward
    reward = make_reward_func(r.metric, r.format_weight, weights=dict(r.weights) if r.weights else None)
    golds = [list(q.golden_answers) for q in questions]
    constant = Counter(q.golden_answers[0] for q in questions).most_common(1)[0][0]
    copied = [_copier(q, d) for q, d in zip(questions, documents, strict=True)]
    n = len(questions)
    kwargs = {"golden_answers": golds, "valid_format": [True] * n}  # both follow the format
    r_const = reward([None] * n, [None] * n, final_answer=[constant] * n, **kwargs)
    r_copy = reward([None] * n, [None] * n, final_answer=copied, **kwargs)
    # the constant is right on a large share of these questions: the comparison is not a foregone one
    assert 0.3 < sum(exact_match(constant, g) for g in golds) / n < 0.6
    assert sum(r_const) / n < sum(r_copy) / n
    both_wrong = [
        i for i in range(n) if not exact_match(constant, golds[i]) and not exact_match(copied[i], golds[i])
    ]
    assert len(both_wrong) >= 10
    gap = sum(r_const[i] - r_copy[i] for i in both_wrong) / len(both_wrong)
    assert gap <= 1e-9, f"{recipe}: a wrong constant answer is paid {gap:+.3f} over a wrong copied one"


def test_step_rewards_are_off_and_credited_to_their_searches_when_on():
    """The shipped recipes pay the outcome only; a recipe that turns step rewards on keeps each to its search's
    tokens (reward.step_credit=prefix), so an answer is never paid for the simulator's noise draw."""
    for recipe in RECIPES + ["configs/search-r1-baseline.yaml"]:
        r = load_train_config(ROOT / recipe).reward
        assert r.step_gain_weight == 0 and r.step_redundancy_weight == 0, recipe
    on = load_train_config(ROOT / "configs/demo-learning.yaml", ["reward.step_gain_weight=0.5"]).reward
    assert on.step_credit == "prefix"
