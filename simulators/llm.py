"""The LLM search simulator: an LLM writes the documents a search engine would return.

Each request's result slots are useful or noisy as ``SearchRequest.noise`` says; the simulator writes
the useful slots with one prompt and the noisy slots with another, all prompts of a call in one batched
``generate``, and marks every returned :class:`Document` with its mode.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from simulators.parsing import split_documents
from simulators.prompts import SimulatorPrompts
from zerosim.generation import HFGenerator
from zerosim.search import Document, SearchRequest

EMPTY_RESULT_TEXT = "The search engine returned no readable result for this query."


@dataclass(frozen=True)
class _Job:
    request_index: int
    noisy: bool
    slots: tuple[int, ...]  # result positions this prompt fills
    prompt: str


class LLMSimulator:
    """Implements :class:`zerosim.search.SearchEngine` with an in-process transformers model."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        words_per_doc: int = 30,
        max_new_tokens: int = 192,
        temperature: float = 0.7,
        top_p: float = 0.95,
        pass_answers: bool = True,
        prompts: SimulatorPrompts | None = None,
        seed: int = 0,
    ):
        self.tokenizer = tokenizer
        self.words_per_doc = words_per_doc
        self.max_new_tokens = max_new_tokens
        self.pass_answers = pass_answers
        self.prompts = prompts or SimulatorPrompts()
        self.seed = seed
        self.generator = HFGenerator(model, tokenizer, temperature=temperature, top_p=top_p)
        self.stats: Counter[str] = Counter()

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "auto", **kwargs) -> LLMSimulator:
        from zerosim.models import load_causal_lm, load_tokenizer

        return cls(load_causal_lm(name_or_path, dtype), load_tokenizer(name_or_path), **kwargs)

    def _jobs(self, requests: Sequence[SearchRequest], k: int) -> list[_Job]:
        jobs = []
        for i, req in enumerate(requests):
            pattern = req.noise_for(k)
            for noisy in (False, True):
                slots = tuple(s for s, flag in enumerate(pattern) if flag == noisy)
                if not slots:
                    continue
                prompt = self.prompts.render(
                    query=req.query,
                    k=len(slots),
                    words=self.words_per_doc,
                    noisy=noisy,
                    question=req.question if self.pass_answers else None,
                    answers=req.answers if self.pass_answers else (),
                )
                jobs.append(_Job(i, noisy, slots, prompt))
        return jobs

    def _encode(self, prompt: str) -> list[int]:
        messages = [{"role": "user", "content": prompt}]
        return list(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        )

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        if not requests:
            return []
        jobs = self._jobs(requests, k)
        encoded = [self._encode(job.prompt) for job in jobs]
        # Same inputs + same seed -> same documents, without disturbing the caller's RNG stream.
        digest = hashlib.sha256(repr((self.seed, [j.prompt for j in jobs])).encode()).digest()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little"))
            outputs = self.generator.generate(encoded, self.max_new_tokens)

        results: list[list[Document | None]] = [[None] * k for _ in requests]
        for job, out in zip(jobs, outputs, strict=True):
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            texts = split_documents(text, len(job.slots))
            self.stats["documents_requested"] += len(job.slots)
            self.stats["documents_parsed"] += len(texts)
            for slot, doc_text in zip(job.slots, texts, strict=False):
                query = requests[job.request_index].query
                results[job.request_index][slot] = Document(
                    id=f"sim-{job.request_index}-{slot}", title=query, text=doc_text, noisy=job.noisy
                )
        final: list[list[Document]] = []
        for i, docs in enumerate(results):
            kept = [d for d in docs if d is not None]
            if not kept:
                # Nothing parseable came back: say so explicitly instead of an empty observation.
                self.stats["empty_results"] += 1
                noisy = bool(requests[i].noise_for(k)[0])
                kept = [
                    Document(
                        id=f"sim-{i}-empty", title=requests[i].query, text=EMPTY_RESULT_TEXT, noisy=noisy
                    )
                ]
            final.append(kept)
        self.stats["requests"] += len(requests)
        return final
