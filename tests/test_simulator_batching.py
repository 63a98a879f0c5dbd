"""A batched simulator call writes, for every request, the documents a call with that request alone writes.

Greedy decoding, the in-process transformers backend: on the tiny model and on the embedded SmolLM2 (the
model the demo serves), where batched CPU decoding used to change the text (rounding that depends on the
batch) and the document ids (they named the request's place in the call).
"""

from __future__ import annotations

import pytest

from simulators import LLMSimulator, TransformersBackend
from zerosim.core.data.embedded import load_questions
from zerosim.core.models import load_causal_lm, load_tokenizer
from zerosim.core.search import SearchRequest


def requests(n: int) -> list[SearchRequest]:
    questions = load_questions("factbook", "dev", limit=n)
    return [
        SearchRequest(q.question, q.question, tuple(q.golden_answers), (i % 2 == 1, False, i % 3 == 0))
        for i, q in enumerate(questions)
    ]


@pytest.mark.parametrize("model_name, invariant", [("tiny", False), ("tiny", True), ("smollm2", False)])
def test_batched_documents_equal_one_call_per_request(model_name, invariant, tiny_model_dir):
    path = str(tiny_model_dir) if model_name == "tiny" else "smollm2"
    model, tokenizer = load_causal_lm(path), load_tokenizer(path)
    backend = TransformersBackend(model, tokenizer, model_id=model_name, batch_invariant=invariant)
    sim = LLMSimulator(backend, max_new_tokens=40, temperature=0.0, on_short="fill", seed=0)
    reqs = requests(6)
    batched = sim.search(reqs, 3)
    alone = [sim.search([r], 3)[0] for r in reqs]
    for b, a in zip(batched, alone, strict=True):
        assert [(d.id, d.text, d.noisy) for d in b] == [(d.id, d.text, d.noisy) for d in a]
