"""The LLM search simulator: an LLM writes the documents a search engine would return.

Each request's result slots are useful or noisy as ``SearchRequest.noise`` says; the simulator writes the
useful slots with one prompt and the noisy slots with another, sends all prompts of a call to its
:class:`~simulators.backends.TextBackend` in one batched call, and marks every returned
:class:`Document` with its mode.

The gold answers reach the prompt only when the request carries them (``SearchRequest.question`` and
``answers``): the training rollout's requests do; ``zerosim eval`` and in-training validation strip them
before the simulator sees the request, unless ``search.simulator.pass_answers`` is explicitly ``true``
(a logged override). See docs/simulator.md, "Gold answers: training only".

Short answers (fewer documents than slots, garbled or empty text) are handled by ``on_short``:

- ``"reask"`` — ask once more for the missing slots only (one more batched call), then fill what is still
  missing with an explicit failure document;
- ``"fill"`` — fill the missing slots with an explicit failure document straight away.

A request for which nothing at all could be parsed gets a single failure document. Never an empty
observation, never a crash; every shortfall is counted in :attr:`LLMSimulator.stats`.

Noisy documents that give the answer away (they contain a gold answer, whole words after normalisation —
the check the collect labels use) are handled by ``on_leak`` when the request carries its answers:

- ``"reask"`` — write those slots once more (in the same extra call as the short ones), then relabel what
  still leaks;
- ``"relabel"`` — keep the document but mark it ``noisy=False``: the realised noise the curriculum logs
  stays honest;
- ``"keep"`` — trust the mode (ZeroSearch's behaviour; what ``zerosim simulator eval`` uses to measure the
  model itself).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulators.backends import OpenAIBackend, TextBackend, TransformersBackend
from simulators.cache import CachedSearchEngine
from simulators.config import OnLeak, OnShort, SimulatorConfig
from simulators.parsing import DOCUMENT_PARSERS
from simulators.prompts import PRESETS, SimulatorPrompts, load_prompts
from simulators.relevance import question_coverage
from zerosim.core.http.retry import RetryPolicy
from zerosim.core.metrics import answer_in_text
from zerosim.core.pages import Page, PageRequest
from zerosim.core.search import Document, SearchError, SearchRequest

EMPTY_RESULT_TEXT = "The search engine returned no readable result for this query."
MISSING_DOC_TEXT = "The search engine could not produce this result."
FAILURE_TEXTS = frozenset({EMPTY_RESULT_TEXT, MISSING_DOC_TEXT})


@dataclass(frozen=True)
class _Job:
    request_index: int
    noisy: bool
    slots: tuple[int, ...]  # result positions this prompt fills
    prompt: str


class LLMSimulator:
    """Implements :class:`zerosim.core.search.SearchEngine` with an LLM behind a :class:`TextBackend`.

    Args:
        backend: what completes the prompts (:class:`TransformersBackend`, :class:`OpenAIBackend`, ...).
        words_per_doc: target length of each document (said in the prompt).
        max_new_tokens: generation budget for all documents of one prompt.
        temperature, top_p: sampling settings (temperature 0 = greedy).
        pass_answers: show the question and gold answers a request carries (``None`` counts as ``True``;
            ``False`` = never). Whether a request carries them is the caller's business: the training
            rollout sends them, evaluation and validation withhold them (:class:`eval.harness.WithheldAnswers`)
            unless ``search.simulator.pass_answers`` is explicitly true.
        hint_min_coverage: show them only for a query that holds at least this share of its question's
            content words (:func:`simulators.relevance.question_coverage`); a query below it is written for
            from the query alone, as at evaluation. 0 = whatever the query (ZeroSearch's behaviour).
        prompts: the templates, or a path to a YAML/JSON template file (see :func:`load_prompts`) replacing
            any of ``preset``'s.
        preset: ``"default"`` or ``"zerosearch"`` (:data:`simulators.prompts.PRESETS`): the built-in templates
            and how the output is cut into documents (:data:`simulators.parsing.DOCUMENT_PARSERS`).
        seed: with the same prompts, the same seed gives the same documents.
        on_short: ``"reask"`` or ``"fill"`` — what to do when fewer documents than slots come back.
        on_leak: ``"reask"``, ``"relabel"`` or ``"keep"`` — what to do with a noisy document holding a gold
            answer (see the module docstring).
    """

    metrics_name = "simulator"  # ``stats`` are logged as ``search/simulator/<counter>``

    def __init__(
        self,
        backend: TextBackend,
        *,
        words_per_doc: int = 30,
        max_new_tokens: int = 192,
        temperature: float = 0.7,
        top_p: float = 0.95,
        pass_answers: bool | None = True,
        hint_min_coverage: float = 0.0,
        prompts: SimulatorPrompts | str | Path | None = None,
        seed: int = 0,
        on_short: str = "reask",
        on_leak: str = "reask",
        preset: str = "default",
    ):
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r} is not one of {', '.join(PRESETS)}")
        if on_short not in tuple(OnShort):
            raise ValueError(f"on_short={on_short!r} is not one of {', '.join(OnShort)}")
        if on_leak not in tuple(OnLeak):
            raise ValueError(f"on_leak={on_leak!r} is not one of {', '.join(OnLeak)}")
        if not callable(getattr(backend, "complete", None)):
            raise TypeError(
                f"backend {type(backend).__name__} has no complete(prompts, ...) method (see TextBackend); "
                "wrap a transformers model as TransformersBackend(model, tokenizer)"
            )
        self.backend = backend
        self.words_per_doc = words_per_doc
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.pass_answers = pass_answers is not False  # config null = "training only": requests decide
        if not 0.0 <= hint_min_coverage <= 1.0:
            raise ValueError(f"hint_min_coverage={hint_min_coverage} must be within [0, 1]")
        self.hint_min_coverage = float(hint_min_coverage)
        self.preset = str(preset)
        self.prompts = (
            load_prompts(prompts, base=PRESETS[self.preset])
            if isinstance(prompts, str | Path)
            else prompts or PRESETS[self.preset]
        )
        self.split_documents = DOCUMENT_PARSERS[self.preset]
        self.seed = seed
        self.on_short = on_short
        self.on_leak = on_leak
        self.stats: Counter[str] = Counter()

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, dtype: str = "auto", *, batch_invariant: bool = False, **kwargs: Any
    ) -> LLMSimulator:
        """An in-process simulator on a local checkpoint, HF id or ``smollm2``."""
        backend = TransformersBackend.from_pretrained(name_or_path, dtype, batch_invariant=batch_invariant)
        return cls(backend, **kwargs)

    @classmethod
    def from_openai(cls, base_url: str, model: str, **kwargs: Any) -> LLMSimulator:
        """A simulator whose model runs behind an OpenAI-compatible server.

        Keyword arguments that :class:`OpenAIBackend` takes (``tokenizer`` — object or name/path whose chat
        template wraps the prompts —, ``retry`` — a :class:`~zerosim.core.http.retry.RetryPolicy` —,
        ``max_concurrency``, ``check_health``, ...) go to it; the others to :class:`LLMSimulator`.
        """
        accepted = inspect.signature(OpenAIBackend).parameters
        backend_options = {key: kwargs.pop(key) for key in list(kwargs) if key in accepted}
        return cls(OpenAIBackend(base_url, model, **backend_options), **kwargs)

    @property
    def generator(self):
        """The in-process generator (``TransformersBackend`` only)."""
        try:
            return self.backend.generator
        except AttributeError:
            raise AttributeError(f"{type(self.backend).__name__} runs no in-process generator") from None

    def cache_key_extra(self) -> dict[str, Any]:
        """Everything besides the request that changes this simulator's output (for ``CachedSearchEngine``)."""
        describe = getattr(self.backend, "describe", None)
        backend = describe() if callable(describe) else {"backend": type(self.backend).__name__}
        templates = json.dumps(dataclasses.asdict(self.prompts), sort_keys=True)
        return {
            **backend,
            "templates": hashlib.sha256(templates.encode("utf-8")).hexdigest()[:16],
            "seed": self.seed,
            "words_per_doc": self.words_per_doc,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "pass_answers": self.pass_answers,
            # left out at 0 (the default): existing caches stay valid
            **({"hint_min_coverage": self.hint_min_coverage} if self.hint_min_coverage > 0 else {}),
            "on_short": self.on_short,
            "on_leak": self.on_leak,
            # the preset's parser changes the documents too; left out for default: existing caches stay valid
            **({"preset": self.preset} if self.preset != "default" else {}),
        }

    def close(self) -> None:
        """Release the backend's connections (HTTP); a no-op in process."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    @staticmethod
    def is_cacheable(docs: Sequence[Document]) -> bool:
        """A result holding a failure document is not worth keeping: a new try may do better."""
        return not any(d.text in FAILURE_TEXTS for d in docs)

    # -- prompts ------------------------------------------------------------------------------------

    def _carries_answers(self, req: SearchRequest) -> bool:
        """Whether ``req`` brings a question and gold answers this simulator may be shown."""
        return bool(self.pass_answers and req.question and req.answers)

    def _covers(self, req: SearchRequest) -> bool:
        """Whether ``req``'s query passes the ``hint_min_coverage`` gate."""
        return self.hint_min_coverage <= 0.0 or (
            question_coverage(req.query, req.question or "") >= self.hint_min_coverage
        )

    def _prompt(self, req: SearchRequest, noisy: bool, n: int, hinted: bool) -> str:
        """The prompt for ``n`` slots of ``req``; ``hinted``: show its question and gold answers."""
        return self.prompts.render(
            query=req.query,
            k=n,
            words=self.words_per_doc,
            noisy=noisy,
            question=req.question if hinted else None,
            answers=req.answers if hinted else (),
        )

    def _jobs(self, requests: Sequence[SearchRequest], k: int, hinted: Sequence[bool]) -> list[_Job]:
        """One prompt per (request, mode) present in the request's noise pattern."""
        jobs = []
        for i, req in enumerate(requests):
            pattern = req.noise_for(k)
            for noisy in (False, True):
                slots = tuple(s for s, flag in enumerate(pattern) if flag == noisy)
                if slots:
                    jobs.append(_Job(i, noisy, slots, self._prompt(req, noisy, len(slots), hinted[i])))
        return jobs

    def _complete(self, jobs: Sequence[_Job], salt: str) -> list[str]:
        prompts = [j.prompt for j in jobs]
        # Same prompts + same seed -> same documents; the re-ask draws from its own stream.
        digest = hashlib.sha256(repr((self.seed, salt, prompts)).encode("utf-8")).digest()
        texts = self.backend.complete(
            prompts,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=int.from_bytes(digest[:8], "little") >> 1,  # 63 bits: fits every server's int64 seed
        )
        if len(texts) != len(prompts):
            raise SearchError(
                f"{type(self.backend).__name__} returned {len(texts)} texts for {len(prompts)} prompts"
            )
        return texts

    # -- search -------------------------------------------------------------------------------------

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if k < 1:
            raise ValueError(f"k={k} must be at least 1")
        if not requests:
            return []
        found: list[dict[int, str]] = [{} for _ in requests]
        carries = [self._carries_answers(r) for r in requests]
        hinted = [c and self._covers(r) for c, r in zip(carries, requests, strict=True)]  # once per request
        if self.hint_min_coverage > 0.0:
            # requests whose answers the gate kept from the prompt (their queries miss the question)
            self.stats["answers_withheld"] += sum(c and not h for c, h in zip(carries, hinted, strict=True))
        jobs = self._jobs(requests, k, hinted)
        short = self._collect(jobs, self._complete(jobs, salt=""), found)
        self.stats["documents_requested"] += sum(len(j.slots) for j in jobs)
        redo = short if self.on_short == "reask" else []
        if self.on_leak == "reask":
            leaks = self._leaks(jobs, requests, found)
            self.stats["noisy_leaks"] += sum(len(j.slots) for j in leaks)
            for job in leaks:
                for slot in job.slots:
                    del found[job.request_index][slot]
            redo = _merge(redo + leaks)
        if redo:
            retry = [
                dataclasses.replace(
                    j,
                    prompt=self._prompt(
                        requests[j.request_index], j.noisy, len(j.slots), hinted[j.request_index]
                    ),
                )
                for j in redo
            ]
            self.stats["reasks"] += 1
            self.stats["documents_reasked"] += sum(len(j.slots) for j in retry)
            before = sum(map(len, found))
            self._collect(retry, self._complete(retry, salt="reask"), found)
            self.stats["documents_recovered"] += sum(map(len, found)) - before
            if self.on_leak == "reask":
                # only the slots that leaked the first time: a re-asked short slot may leak for the first time
                still = sum(len(j.slots) for j in self._leaks(leaks, requests, found))
                self.stats["noisy_leaks_fixed"] += sum(len(j.slots) for j in leaks) - still

        results = [self._assemble(i, req, k, found[i]) for i, req in enumerate(requests)]
        self.stats["requests"] += len(requests)
        return results

    # -- pages (the read_page tool) -------------------------------------------------------------------

    def read_pages(self, requests: Sequence[PageRequest], max_words: int) -> list[Page]:
        """A page for each result opened: the simulator writes one document of about ``max_words`` words on
        the result's title (the query it was written for), useful or noisy as the request's curriculum draw
        says, with the question and answers where a search of that query would be shown them. A noisy page
        that holds a gold answer is relabelled useful (as ``on_leak=relabel`` does); one the simulator
        writes nothing parseable for says so (:data:`EMPTY_RESULT_TEXT`), counted in ``pages_empty``."""
        if not requests:
            return []
        budget = max(self.max_new_tokens, int(max_words * 1.5))
        prompts = []
        for r in requests:
            search = SearchRequest(
                query=r.document.title or r.document.text, question=r.question, answers=r.answers
            )
            hinted = self._carries_answers(search) and self._covers(search)
            prompts.append(
                self.prompts.render(
                    query=search.query,
                    k=1,
                    words=max_words,
                    noisy=bool(r.noisy),
                    question=search.question if hinted else None,
                    answers=search.answers if hinted else (),
                )
            )
        digest = hashlib.sha256(repr((self.seed, "page", prompts)).encode("utf-8")).digest()
        texts = self.backend.complete(
            prompts,
            max_new_tokens=budget,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=int.from_bytes(digest[:8], "little") >> 1,
        )
        if len(texts) != len(prompts):
            raise SearchError(
                f"{type(self.backend).__name__} returned {len(texts)} texts for {len(prompts)} page prompts"
            )
        pages = []
        for r, text in zip(requests, texts, strict=True):
            parsed = self.split_documents(text, 1)
            body = parsed[0] if parsed else text.strip()
            noisy = bool(r.noisy)
            if not body:
                self.stats["pages_empty"] += 1
                body = EMPTY_RESULT_TEXT
            elif noisy and r.answers and answer_in_text(body, r.answers):
                self.stats["pages_relabelled"] += 1
                noisy = False
            pages.append(Page(title=r.document.title, text=body, noisy=noisy))
        self.stats["pages"] += len(requests)
        return pages

    def _collect(self, jobs: Sequence[_Job], texts: Sequence[str], found: list[dict[int, str]]) -> list[_Job]:
        """Put each job's parsed documents into its slots; return jobs narrowed to the slots still missing."""
        short = []
        for job, text in zip(jobs, texts, strict=True):
            parsed = self.split_documents(text, len(job.slots))
            self.stats["documents_parsed"] += len(parsed)
            for slot, doc_text in zip(job.slots, parsed, strict=False):
                found[job.request_index][slot] = doc_text
            missing = job.slots[len(parsed) :]
            if missing:
                short.append(dataclasses.replace(job, slots=missing))
        return short

    def _leaks(
        self, jobs: Sequence[_Job], requests: Sequence[SearchRequest], found: list[dict[int, str]]
    ) -> list[_Job]:
        """Noisy jobs narrowed to the slots whose written document holds one of the request's gold answers."""
        out = []
        for job in jobs:
            answers = requests[job.request_index].answers
            if not job.noisy or not answers:
                continue
            texts = found[job.request_index]
            slots = tuple(s for s in job.slots if s in texts and answer_in_text(texts[s], answers))
            if slots:
                out.append(dataclasses.replace(job, slots=slots))
        return out

    def _assemble(self, i: int, req: SearchRequest, k: int, texts: dict[int, str]) -> list[Document]:
        pattern = list(req.noise_for(k))
        if self.on_leak != "keep" and req.answers:
            for slot, text in texts.items():
                if pattern[slot] and answer_in_text(text, req.answers):
                    pattern[slot] = False  # it answers the question: not noise, whatever the prompt asked
                    self.stats["noisy_relabelled"] += 1
        missing = k - len(texts)
        self.stats["documents_filled"] += missing
        if not texts:
            # Nothing parseable came back: say so once, explicitly, instead of an empty observation.
            self.stats["empty_results"] += 1
            return [
                Document(
                    id=document_id(req.query, "empty", EMPTY_RESULT_TEXT),
                    title=req.query,
                    text=EMPTY_RESULT_TEXT,
                    noisy=pattern[0],
                )
            ]
        return [
            Document(
                id=document_id(req.query, slot, texts.get(slot, MISSING_DOC_TEXT)),
                title=req.query,
                text=texts.get(slot, MISSING_DOC_TEXT),
                noisy=pattern[slot],
            )
            for slot in range(k)
        ]


def _merge(jobs: Sequence[_Job]) -> list[_Job]:
    """One job per (request, mode), its slots the union of the given jobs' (a short job may also leak)."""
    slots: dict[tuple[int, bool], set[int]] = {}
    for job in jobs:
        slots.setdefault((job.request_index, job.noisy), set()).update(job.slots)
    return [_Job(i, noisy, tuple(sorted(s)), "") for (i, noisy), s in sorted(slots.items())]


def document_id(query: str, slot: int | str, text: str) -> str:
    """``sim-<digest>-<slot>``: a simulated document's id, from what it is (query, slot, text), never from
    where its request sat in a call: one request alone or in a batch gets the same ids, and two different
    documents written at the same place in two calls do not share one (step rewards count an id seen
    before as a repeat)."""
    digest = hashlib.sha256(f"{query}\x1f{slot}\x1f{text}".encode()).hexdigest()[:12]
    return f"sim-{digest}-{slot}"


def build_simulator(
    cfg: SimulatorConfig, *, seed: int = 0, dtype: str = "auto"
) -> LLMSimulator | CachedSearchEngine:
    """The simulator ``search.simulator`` describes (its backend; behind a cache with ``cache=true``)."""
    options = dict(
        words_per_doc=cfg.words_per_doc,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        pass_answers=cfg.pass_answers,
        hint_min_coverage=cfg.hint_min_coverage,
        prompts=cfg.prompts_file,
        preset=cfg.prompts,
        on_short=cfg.on_short,
        on_leak=cfg.on_leak,
        seed=seed,
    )
    if cfg.backend == "openai":
        engine = LLMSimulator.from_openai(
            cfg.url,
            cfg.served_model or cfg.model,
            tokenizer=cfg.model if cfg.chat_template else None,
            retry=RetryPolicy.of(cfg),
            max_concurrency=cfg.max_concurrency,
            **options,
        )
    else:
        engine = LLMSimulator.from_pretrained(
            cfg.model, dtype=dtype, batch_invariant=cfg.batch_invariant, **options
        )
    if cfg.cache:
        return CachedSearchEngine(engine, max_entries=cfg.cache_size, sqlite_path=cfg.cache_path)
    return engine
