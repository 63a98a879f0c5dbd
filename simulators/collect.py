"""``zerosim simulator collect``: the SFT dataset a search simulator is fine-tuned on.

Pipeline: questions from a QA dataset → queries (the questions themselves, or the ``<search>`` queries a
policy writes when rolled out against a real retriever) → the retriever's top-``depth`` documents for each
query → each document labelled *useful* or *noisy* (a gold answer occurs in it, or an LLM judge says so) →
per query, one *useful* example (the useful documents, up to ``k``) and one *noisy* example (the noisy ones):
the prompt is the simulator's own prompt for that mode — the same template the simulator is prompted with
at RL time — and the completion is the documents as ``Doc i: ...`` lines, which is what the simulator's
parser reads. A model fine-tuned on these rows writes real-looking useful or noisy documents on request.

Documents are cut to ``words_per_doc`` words; a useful one keeps the window around its first gold-answer
mention, so the cut never removes what made it useful. The dataset is a jsonl loadable by ``datasets``
(``prompt``/``completion`` in conversational form, plus ``mode`` and provenance columns), written
atomically, with a class-balance report next to it.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from simulators.config import CollectConfig, JudgeConfig
from simulators.prompts import SimulatorPrompts, preset_prompts
from zerosim.core.data.jsonl import write_jsonl
from zerosim.core.data.qa import QAExample
from zerosim.core.fsutil import atomic_write_text
from zerosim.core.judge import MAX_TOKENS, parse_verdict
from zerosim.core.metrics import answer_in_text
from zerosim.core.search import Document, SearchEngine, SearchError, SearchRequest

MODES = ("useful", "noisy")

JUDGE_PROMPT = (
    "You check search results. Question: {question}\nCorrect answer: {answers}\n"
    "Document: {document}\n"
    "Does the document state the correct answer or a fact that directly gives it? Reply with yes or no."
)


@dataclass(frozen=True)
class QueryDocs:
    """One query with the question it serves and the retriever's ranked documents for it."""

    query: str
    example: QAExample
    documents: tuple[Document, ...]


@dataclass
class CollectResult:
    path: Path
    report: dict[str, Any]
    rows: list[dict[str, Any]] = field(repr=False, default_factory=list)


# -- documents ------------------------------------------------------------------------------------------


_SEGMENT_END = re.compile(r"(?<=[.!?;])\s+|\s+\|\s+")


def _segments(text: str) -> list[str]:
    """``text`` cut after sentence ends and at `` | `` field separators, each piece keeping its separator."""
    pieces, last = [], 0
    for m in _SEGMENT_END.finditer(text):
        pieces.append(text[last : m.end()])
        last = m.end()
    pieces.append(text[last:])
    return [p for p in pieces if p.strip()]


def _window(tokens: list[str], words: int, answers: Sequence[str]) -> str:
    start = 0
    if answers:
        span = max(len(a.split()) for a in answers) + 2
        for i in range(len(tokens)):
            if answer_in_text(" ".join(tokens[i : i + span]), answers):
                start = max(0, min(i - words // 3, len(tokens) - words))
                break
    return " ".join(tokens[start : start + words])


def clip_words(text: str, words: int, answers: Sequence[str] = ()) -> str:
    """``text`` cut to at most ``words`` words, on sentence / field boundaries where possible.

    Without ``answers`` the cut keeps the beginning. With them, it keeps the segment holding the first
    answer mention and grows around it (preceding segments first: they name what the fact is about) while
    the budget allows; a segment longer than the budget is cut to a word window around the mention.
    """
    tokens = text.split()
    if len(tokens) <= words:
        return " ".join(tokens)
    segments = _segments(text)
    sizes = [len(seg.split()) for seg in segments]
    hit = next((i for i, seg in enumerate(segments) if answers and answer_in_text(seg, answers)), None)
    if hit is None and answers and answer_in_text(text, answers):
        return _window(tokens, words, answers)  # the mention spans a boundary
    centre = 0 if hit is None else hit
    if sizes[centre] > words:
        return _window(segments[centre].split(), words, answers if hit is not None else ())
    lo = hi = centre
    budget = words - sizes[centre]
    while True:
        if lo > 0 and sizes[lo - 1] <= budget:
            lo -= 1
            budget -= sizes[lo]
        elif hi + 1 < len(segments) and sizes[hi + 1] <= budget:
            hi += 1
            budget -= sizes[hi]
        else:
            break
    return " ".join(" ".join(segments[lo : hi + 1]).split()).rstrip(" |")


def format_completion(texts: Sequence[str]) -> str:
    """Documents as the simulator is asked to write them: ``Doc 1: ...`` one per line."""
    return "\n".join(f"Doc {i}: {t}" for i, t in enumerate(texts, 1))


def _document_text(doc: Document) -> str:
    return f"{doc.title}: {doc.text}" if doc.title and not doc.text.startswith(doc.title) else doc.text


# -- labelling ----------------------------------------------------------------------------------------------


class ContainmentLabeler:
    """Useful iff a gold answer occurs (whole words, normalised) in the document."""

    name = "contains"

    def label(self, items: Sequence[tuple[QAExample, str]]) -> list[tuple[bool, str]]:
        return [(answer_in_text(text, ex.golden_answers), self.name) for ex, text in items]


class JudgeLabeler:
    """An LLM decides useful/noisy; an answer that starts with neither yes nor no falls back to containment.

    The answer is read as the reward judge reads its own (:func:`zerosim.core.judge.parse_verdict`).

    Every fallback is counted in the report (``label_fallbacks``): a judge that rarely answers yes/no is a
    judge to replace, not to trust.
    """

    name = "judge"

    def __init__(self, backend, max_new_tokens: int = MAX_TOKENS, batch_size: int = 32):
        self.backend = backend
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    @classmethod
    def from_config(cls, cfg: JudgeConfig) -> JudgeLabeler:
        from simulators.backends import OpenAIBackend, TransformersBackend

        if cfg.backend == "openai":
            backend = OpenAIBackend(cfg.url, cfg.model, tokenizer=cfg.model)
        else:
            backend = TransformersBackend.from_pretrained(cfg.model)
        return cls(backend, max_new_tokens=cfg.max_new_tokens)

    def label(self, items: Sequence[tuple[QAExample, str]]) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            prompts = [
                JUDGE_PROMPT.format(question=ex.question, answers="; ".join(ex.golden_answers), document=text)
                for ex, text in chunk
            ]
            texts = self.backend.complete(
                prompts, max_new_tokens=self.max_new_tokens, temperature=0.0, top_p=1.0, seed=0
            )
            if len(texts) != len(prompts):
                raise SearchError(f"the judge returned {len(texts)} answers for {len(prompts)} documents")
            for (ex, doc_text), answer in zip(chunk, texts, strict=True):
                verdict = parse_verdict(answer)
                if verdict is None:
                    out.append((answer_in_text(doc_text, ex.golden_answers), "contains-fallback"))
                else:
                    out.append((verdict == 1.0, self.name))
        return out


# -- queries ------------------------------------------------------------------------------------------------


class RecordingEngine:
    """Passes searches to a real retriever at ``depth`` and records every query with its documents.

    The policy sees the top ``k``; the SFT data gets all ``depth`` documents of each query.
    """

    def __init__(self, inner: SearchEngine, depth: int):
        self.inner = inner
        self.depth = depth
        self.records: list[tuple[SearchRequest, list[Document]]] = []

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        plain = [SearchRequest(query=r.query, question=r.question, answers=r.answers) for r in requests]
        results = self.inner.search(plain, max(k, self.depth))
        self.records.extend(zip(requests, results, strict=True))
        return [docs[:k] for docs in results]


def question_queries(
    questions: Sequence[QAExample], retriever: SearchEngine, depth: int, batch_size: int
) -> list[QueryDocs]:
    out = []
    for start in tqdm(range(0, len(questions), batch_size), desc="retrieve", unit="batch"):
        batch = questions[start : start + batch_size]
        results = retriever.search([SearchRequest(query=q.question) for q in batch], depth)
        out.extend(QueryDocs(q.question, q, tuple(d)) for q, d in zip(batch, results, strict=True))
    return out


def policy_queries(
    cfg: CollectConfig,
    questions: Sequence[QAExample],
    retriever: SearchEngine,
    *,
    generator=None,
    tokenizer=None,
) -> list[QueryDocs]:
    """The ``<search>`` queries ``cfg.policy`` writes for each question, rolled out against ``retriever``.

    Each distinct (question, query) pair is kept once, with the retriever's top ``depth`` documents.
    ``generator``/``tokenizer`` replace the policy loaded from ``cfg.policy`` (tests script them).
    """
    from zerosim.agent.rollout import SearchRollout, build_prompt
    from zerosim.core.models import load_causal_lm, load_tokenizer

    tokenizer = tokenizer or load_tokenizer(cfg.policy)
    recorder = RecordingEngine(retriever, cfg.depth)
    by_question = {q.question: q for q in questions}
    rollout = SearchRollout(
        tokenizer,
        recorder,
        config=cfg.rollout,
        k=cfg.k,
        examples={build_prompt(q.question): (q.question, q.golden_answers) for q in questions},
    )
    generator = generator or rollout.generator_for(load_causal_lm(cfg.policy))
    for start in tqdm(range(0, len(questions), cfg.batch_size), desc="policy rollouts", unit="batch"):
        batch = questions[start : start + cfg.batch_size]
        rollout.run(generator, [build_prompt(q.question) for q in batch], step=0)
    seen: set[tuple[str, str]] = set()
    out = []
    for request, docs in recorder.records:
        key = (request.question or "", request.query)
        if request.query.strip() and key not in seen:
            seen.add(key)
            out.append(QueryDocs(request.query, by_question[request.question], tuple(docs)))
    return out


# -- examples -----------------------------------------------------------------------------------------------


def build_rows(
    items: Sequence[QueryDocs],
    labeler,
    *,
    k: int,
    words_per_doc: int,
    prompts: SimulatorPrompts,
    pass_answers: bool,
) -> tuple[list[dict[str, Any]], Counter]:
    """One useful and one noisy SFT row per query (when it has documents of that mode); plus counts."""
    counts: Counter = Counter()
    pending: list[tuple[int, Document, str]] = []
    for i, item in enumerate(items):
        answers = item.example.golden_answers
        for doc in item.documents:
            full = _document_text(doc)
            # Clip around the answer: a useful document must still hold it after the cut.
            pending.append((i, doc, clip_words(full, words_per_doc, answers)))
    labels = labeler.label([(items[i].example, text) for i, _, text in pending])
    per_query: list[dict[str, list[tuple[Document, str]]]] = [{m: [] for m in MODES} for _ in items]
    for (i, doc, text), (useful, by) in zip(pending, labels, strict=True):
        counts[f"documents_{'useful' if useful else 'noisy'}"] += 1
        counts[f"labelled_by_{by}"] += 1
        per_query[i]["useful" if useful else "noisy"].append((doc, text))

    rows = []
    for item, groups in zip(items, per_query, strict=True):
        ex = item.example
        if not groups["useful"]:
            counts["queries_without_useful"] += 1
        if not groups["noisy"]:
            counts["queries_without_noisy"] += 1
        for mode in MODES:
            chosen = groups[mode][:k]
            if not chosen:
                continue
            prompt = prompts.render(
                query=item.query,
                k=len(chosen),
                words=words_per_doc,
                noisy=mode == "noisy",
                question=ex.question if pass_answers else None,
                answers=ex.golden_answers if pass_answers else (),
            )
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "completion": [
                        {"role": "assistant", "content": format_completion([t for _, t in chosen])}
                    ],
                    "mode": mode,
                    "num_documents": len(chosen),
                    "query": item.query,
                    "question": ex.question,
                    "answers": list(ex.golden_answers),
                    "question_id": ex.id,
                    "doc_ids": [d.id for d, _ in chosen],
                }
            )
    return rows, counts


def balance_rows(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """As many useful as noisy rows; order kept, seeded.

    The smaller mode is kept whole. From the larger one, rows whose query also has a row of the smaller
    mode come first: contrasting pairs (same query, both modes) are what teach the model the mode rather
    than the query. The rest is filled at random.
    """
    by_mode = {m: [i for i, r in enumerate(rows) if r["mode"] == m] for m in MODES}
    small, large = sorted(MODES, key=lambda m: len(by_mode[m]))
    n = len(by_mode[small])
    rng = random.Random(seed)
    key = lambda r: (r["question_id"], r["query"])  # noqa: E731
    paired_keys = {key(rows[i]) for i in by_mode[small]}
    paired = [i for i in by_mode[large] if key(rows[i]) in paired_keys]
    unpaired = [i for i in by_mode[large] if key(rows[i]) not in paired_keys]
    chosen = rng.sample(paired, min(n, len(paired)))
    chosen += rng.sample(unpaired, n - len(chosen))
    keep = set(by_mode[small]) | set(chosen)
    return [r for i, r in enumerate(rows) if i in keep]


def run_collect(
    cfg: CollectConfig,
    *,
    retriever: SearchEngine | None = None,
    build_engine: Callable[..., SearchEngine] | None = None,
) -> CollectResult:
    """Build the SFT dataset and its report (``<out>.report.json``); returns both.

    The documents come from ``retriever``, or from ``build_engine(cfg.search, seed=cfg.seed)`` (the app's
    factory, :func:`zerosim.engines.build_search_engine`) once the questions are read.
    """
    from zerosim.core.data.embedded import load_questions

    questions = load_questions(cfg.data, cfg.split)
    if not questions:
        raise ValueError(f"{cfg.data} ({cfg.split}) holds no questions to collect from")
    rng = random.Random(cfg.seed)
    if cfg.max_questions is not None and cfg.max_questions < len(questions):
        questions = rng.sample(questions, cfg.max_questions)
    if retriever is None:
        if cfg.search.engine in ("simulator", "mixed"):
            raise ValueError(
                f"search.engine={cfg.search.engine}: collect needs a real retriever (bm25, dense, hybrid or "
                "http) — the documents a simulator is trained to imitate"
            )
        if build_engine is None:
            raise TypeError(
                "run_collect needs retriever= or build_engine= (zerosim.engines.build_search_engine)"
            )
        retriever = build_engine(cfg.search, seed=cfg.seed)
    if cfg.queries == "policy":
        items = policy_queries(cfg, questions, retriever)
        if not items:
            raise ValueError(
                f"the policy {cfg.policy} wrote no <search> query for any of {len(questions)} questions; "
                "warm-start it first (zerosim policy warmstart) or use queries=question"
            )
    else:
        items = question_queries(questions, retriever, cfg.depth, cfg.batch_size)
    labeler = JudgeLabeler.from_config(cfg.judge) if cfg.label == "judge" else ContainmentLabeler()
    prompts = preset_prompts(cfg.prompts, cfg.prompts_file)  # the RL-time templates of that preset
    rows, counts = build_rows(
        items,
        labeler,
        k=cfg.k,
        words_per_doc=cfg.words_per_doc,
        prompts=prompts,
        pass_answers=cfg.pass_answers,
    )
    before = Counter(r["mode"] for r in rows)
    if not rows:
        raise ValueError(
            f"no SFT rows: {len(items)} queries gave no labelled documents (check the retriever and data)"
        )
    if cfg.balance and not before["useful"]:
        raise ValueError(
            "balance=true but no query has a useful document: the retriever never returns a gold answer "
            "for these questions (check data/corpus, or set balance=false)"
        )
    if cfg.balance:
        rows = balance_rows(rows, cfg.seed)
    after = Counter(r["mode"] for r in rows)
    docs = counts["documents_useful"] + counts["documents_noisy"]
    report = {
        "questions": len(questions),
        "queries": len(items),
        "queries_from": cfg.queries,
        "label": cfg.label,
        "documents": docs,
        "documents_useful": counts["documents_useful"],
        "documents_noisy": counts["documents_noisy"],
        "useful_document_share": counts["documents_useful"] / docs if docs else 0.0,
        "label_fallbacks": counts["labelled_by_contains-fallback"],
        "queries_without_useful": counts["queries_without_useful"],
        "queries_without_noisy": counts["queries_without_noisy"],
        "rows_before_balance": dict(before),
        "rows": dict(after),
        "balanced": cfg.balance,
        "mean_documents_per_row": sum(r["num_documents"] for r in rows) / len(rows),
    }
    out = Path(cfg.out)
    write_jsonl(out, rows)  # atomic: a crash never leaves a half-written dataset under the final name
    report_path = out.with_name(out.name + ".report.json")
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return CollectResult(out, report, rows)
