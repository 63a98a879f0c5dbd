"""The agent loop: multi-turn search rollouts of a policy against a search engine.

The loop returns trajectories and computes their metrics (a dict); it knows no trainer. Training uses it
through :class:`zerosim.training.trl_rollout.TRLRollout`, TRL's ``rollout_func``; evaluation, validation and
collection call :meth:`SearchRollout.run` directly.

Token contract (what the trainer's loss relies on): for every trajectory, ``completion_ids``,
``env_mask`` and ``logprobs`` have the same length; tokens the policy sampled have ``env_mask`` 1 and
their sampling log-prob; tokens the environment inserted (``<information>`` blocks, corrective
observations) have ``env_mask`` 0 and log-prob 0. Policy tokens are kept exactly as sampled — never
decoded and re-tokenised.

Each turn generates for all active trajectories in one batch, stopping at ``</search>``, ``</answer>``
or EOS; every search of the turn goes to the engine in one call.

With several training processes each rank rolls out its own slice of the batch, in lockstep: every turn
starts with one all-reduce (:class:`zerosim.core.distributed.TurnSync`), a rank whose trajectories are all done
keeps taking part in collective generation (``idle``) and calls the engine every turn like the others,
until no rank has work left. What the curriculum decides per search comes in as functions of (step,
trajectory's index in the global batch, search number) — its noise pattern (``noise``, e.g.
:class:`curricula.CurriculumNoise`) and, under ``search.engine=mixed``, its source (``source``, e.g.
:meth:`curricula.MixedSearchEngine.draw_source`) — so a rank draws what one process rolling out the whole
batch would have drawn, and the loop knows no schedule. ``mixed/*`` metrics split a step by source.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from zerosim.agent.protocol import extract_answer, parse_action
from zerosim.agent.step_rewards import search_step_rewards
from zerosim.agent.tools import INVALID_KINDS, InvalidCall, ToolCall, parse_tool_calls, tools_named
from zerosim.core.config import ranged
from zerosim.core.distributed import SingleProcess
from zerosim.core.generation import Generation, HFGenerator
from zerosim.core.metrics import exact_match, f1_score
from zerosim.core.models import encode_chat_prompt
from zerosim.core.sampling import Sampling
from zerosim.core.search import (
    Document,
    SearchEngine,
    SearchError,
    SearchRequest,
    answers_empty,
    engine_layers,
    format_documents,
)


class Protocol(StrEnum):
    """How the policy acts: Search-R1's tags, or tool calls in its chat template's format (docs/agents.md)."""

    tags = "tags"
    tools = "tools"


@dataclass
class RolloutConfig:
    # how the policy acts: tags (<search>/<answer>, Search-R1) | tools (calls in its chat template's format; answer in <answer>)
    protocol: Protocol = Protocol.tags
    # protocol=tools: the tools offered, from the table in zerosim/agent/tools.py
    tools: list[str] = field(default_factory=lambda: ["search"])
    # protocol=tools: tool calls one trajectory may make (past it a call is invalid: tools/invalid/over_budget)
    max_tool_calls: int = ranged(4, ">=1")
    # generation turns per trajectory (searches happen in all but the last)
    max_turns: int = ranged(3, ">=1")
    # tokens the policy may write per turn
    max_new_tokens: int = ranged(128, ">=1")
    # tokens of retrieved documents kept per <information> block
    max_obs_tokens: int = ranged(256, ">=1")
    # protocol=tools with read_page: tokens of a page kept per reply
    max_page_tokens: int = ranged(384, ">=1")
    # hard cap on one trajectory's completion (policy + observations)
    max_completion_tokens: int = ranged(768, ">=1")
    # policy sampling temperature
    temperature: float = ranged(1.0, ">=0", "0 = greedy")
    # policy nucleus sampling
    top_p: float = ranged(1.0, "(0,1]")


STOP_STRINGS = ("</search>", "</answer>")


def stop_strings(config: RolloutConfig) -> tuple[str, ...]:
    """Where a turn's generation stops besides EOS: a closing tag under tags; nothing under tools (a turn may
    hold several calls, and ends at the template's end-of-turn token)."""
    return STOP_STRINGS if config.protocol == Protocol.tags else ()


INFO_OPEN = "\n\n<information>"
INFO_CLOSE = "</information>\n\n"
INVALID_ACTION = (
    "\nMy previous action is invalid. To search, I put the query between <search> and </search>. "
    "To give the final answer, I put it between <answer> and </answer>. Let me try again.\n"
)

NO_ACTION = (
    "Your message called no tool and gave no answer. To look something up, call a tool. To give the final answer, "
    "write it between <answer> and </answer>."
)

INSTRUCTION = (
    "Answer the question below. Reason inside <think> and </think> first. If you lack a fact, search for "
    "it by writing <search> query </search>; the results come back between <information> and "
    "</information>. You may search several times. When you know the answer, write it, in a few words, "
    "between <answer> and </answer>, for example <answer> Paris </answer>.\nQuestion: {question}"
)

# What the training loop decides per search, handed to the rollout as plain functions of
# (step, trajectory's index in the global batch, search number): the curriculum's noise pattern of the search's
# k slots (None: no noise) and, under search.engine=mixed, the source that answers it ("sim" / "real").
NoiseFn = Callable[[int, int, int], "tuple[bool, ...] | None"]
SourceFn = Callable[[int, int, int], "str | None"]
SOURCE_GROUPS = (
    "real",
    "sim",
    "both",
    "none",
)  # a trajectory's searches: all real, all simulated, mixed, none


def page_text(page) -> str:
    """A :class:`~zerosim.core.pages.Page` as ``read_page``'s reply shows it (before clipping)."""
    return f"Page (Title: {page.title})\n{page.text}"


def page_words(config: RolloutConfig) -> int:
    """The words asked of a page: about what ``rollout.max_page_tokens`` holds."""
    return max(1, int(config.max_page_tokens * 0.75))


def build_prompt(question: str) -> str:
    """The user message that asks the policy to answer ``question`` with the search protocol."""
    return INSTRUCTION.format(question=question.strip())


@dataclass
class Trajectory:
    """One question's multi-turn interaction; the token lists follow the module's contract."""

    prompt_ids: list[int]
    question: str
    answers: tuple[str, ...]
    index: int = 0  # position in the global batch (all ranks): the noise draws' stream
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    searches: int = 0
    invalid_actions: int = 0
    documents: int = 0
    noisy_documents: int = 0
    answer: str | None = None
    finish: str = ""  # answer | eos | no_answer | max_tokens
    events: list[dict[str, Any]] = field(default_factory=list)
    retrieved: list[Document] = field(default_factory=list)  # every document shown, in order
    search_docs: list[list[Document]] = field(default_factory=list)  # per search, its documents
    search_close: list[int] = field(default_factory=list)  # per search, index of its closing policy token
    step_rewards: list[float] = field(default_factory=list)  # per search (StepSearch-style), when enabled
    sources: list[str] = field(default_factory=list)  # search.engine=mixed: per search, "real" or "sim"
    tool_calls: int = 0  # protocol=tools: calls made (valid or not)
    invalid_calls: Counter = field(default_factory=Counter)  # protocol=tools: per kind (tools.INVALID_KINDS)
    pages: int = 0  # read_page: pages opened
    noisy_pages: int = 0  # read_page: of them, written noisy by the simulator

    @property
    def results(self) -> list[Document]:
        """Every search result shown, numbered from 1 in this order (what ``read_page``'s ``doc`` names)."""
        return [d for docs in self.search_docs for d in docs]

    @property
    def done(self) -> bool:
        return bool(self.finish)

    @property
    def source_group(self) -> str:
        """``real`` / ``sim`` (every search answered by that source), ``both``, or ``none`` (no search)."""
        kinds = set(self.sources)
        if not kinds:
            return "none"
        return "both" if len(kinds) > 1 else next(iter(kinds))

    @property
    def valid_format(self) -> bool:
        """Ended with an answer and never took an invalid action."""
        return self.answer is not None and self.invalid_actions == 0

    @property
    def step_reward_positions(self) -> list[tuple[int, float]]:
        """``(index of the token that closed the search's </search>, its step reward)`` per search whose
        closing token is still in the (capped) completion; empty without step rewards."""
        return [
            (i, r)
            for i, r in zip(self.search_close, self.step_rewards, strict=False)
            if i < len(self.completion_ids)
        ]

    def add_policy(self, gen: Generation) -> None:
        self.completion_ids += gen.token_ids
        self.env_mask += [1] * len(gen.token_ids)
        self.logprobs += gen.logprobs

    def add_environment(self, ids: Sequence[int]) -> None:
        self.completion_ids += ids
        self.env_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)


class ProtocolTokens:
    """The token pieces of the search protocol: the chat-formatted prompt, observation blocks, the
    corrective message. RL rollouts and warm-start SFT data both use these, so they agree token for token."""

    def __init__(self, tokenizer, max_obs_tokens: int):
        self.tokenizer = tokenizer
        self.max_obs_tokens = max_obs_tokens
        self.info_open = self.encode(INFO_OPEN)
        self.info_close = self.encode(INFO_CLOSE)
        self.invalid = self.encode(INVALID_ACTION)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, text: str) -> list[int]:
        """The user message ``text`` in the chat template, ready for the assistant's first token."""
        return encode_chat_prompt(self.tokenizer, text)

    def observation(self, docs: Sequence[Document]) -> list[int]:
        """``<information>`` + the formatted documents clipped to ``max_obs_tokens`` + ``</information>``."""
        body = self.encode(format_documents(docs))[: self.max_obs_tokens]
        return self.info_open + body + self.info_close


class SearchRollout:
    """Runs search trajectories for a batch of prompts (:meth:`run`) and computes their metrics
    (:meth:`metrics`).

    ``examples`` maps each prompt string to its ``(question, gold answers)``: the caller (TRL, through
    :class:`zerosim.training.trl_rollout.TRLRollout`) passes only the prompts, while the simulator needs the question
    and answers of each one.
    """

    def __init__(
        self,
        tokenizer,
        engine: SearchEngine,
        *,
        config: RolloutConfig,
        k: int,
        examples: Mapping[str, tuple[str, Sequence[str]]],
        noise: NoiseFn | None = None,
        source: SourceFn | None = None,
        step_metrics: Callable[[int], Mapping[str, float]] | None = None,
        step_rewards: tuple[float, float] | None = None,
        pages: Any = None,
        page_by: str = "title",
    ):
        self.tokenizer = tokenizer
        self.engine = engine
        # web search: a search that found nothing is an answer (NO_RESULTS), every other engine's is a fault
        self.empty_answers = answers_empty(engine)
        self.config = config
        self.k = k
        self.examples = examples
        self.noise = noise  # None: every search as the engine gives it (evaluation, validation, collection)
        self.source = source  # None: the engine decides (one engine, or a mixed one drawing itself)
        self.step_metrics = step_metrics  # the caller's per-step values (the curriculum's p, the real share)
        self.step_rewards = step_rewards  # (gain weight, redundancy weight) or None
        self.tokens = ProtocolTokens(tokenizer, config.max_obs_tokens)
        self.eos_ids = [tokenizer.eos_token_id]
        self.tool_tokens = None
        if config.protocol == Protocol.tools:
            from zerosim.agent.tool_format import ToolTokens  # TRL's template, loaded only here

            self.offered = {t.name: t for t in tools_named(config.tools)}
            missing = [n for n in self.offered if not callable(getattr(self, f"execute_{n}", None))]
            if missing:
                raise TypeError(
                    f"tools {missing} have no executor: SearchRollout.execute_<name> (zerosim/agent/tools.py)"
                )
            self.tool_tokens = ToolTokens(tokenizer, list(self.offered.values()), config.max_obs_tokens)
            self.eos_ids = [self.tool_tokens.eos_id]
            if "read_page" in self.offered and pages is None:
                from zerosim.core.pages import page_reader

                pages = page_reader(engine, by=page_by)
                if pages is None:
                    raise ValueError(
                        f"rollout.tools offers read_page, but the search engine ({type(engine).__name__}) has no "
                        "pages to open: use bm25, dense, hybrid, simulator or mixed, or drop read_page"
                    )
        self.pages = pages  # read_page: the pages behind the engine's results (zerosim.core.pages)

    def encode_prompt(self, prompt: str) -> list[int]:
        if self.tool_tokens is not None:  # the question with the tools' schemas, in the chat template
            return self.tool_tokens.prompt(self.examples[prompt][0])
        return self.tokens.prompt(prompt)

    def generator_for(self, model, collective: bool = False) -> HFGenerator:
        return HFGenerator(
            model,
            self.tokenizer,
            sampling=Sampling.of(
                self.config, stop_strings=stop_strings(self.config), eos_token_ids=self.eos_ids
            ),
            collective=collective,
        )

    # -- the loop ----------------------------------------------------------------------------------------
    def run(
        self, generator, prompts: Sequence[Any], step: int, *, sync=None, offset: int = 0
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Roll out one trajectory per prompt; returns them and the time spent generating and searching.

        ``sync`` (:class:`TurnSync`) keeps the ranks of a multi-process run in lockstep; ``offset`` is the
        global index of this rank's first trajectory.
        """
        cfg = self.config
        sync = sync or SingleProcess()
        trajectories = []
        for i, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            if text not in self.examples:
                raise KeyError(f"rollout got a prompt that is not in the training data: {text[:80]!r}")
            question, answers = self.examples[text]
            trajectories.append(
                Trajectory(self.encode_prompt(text), question, tuple(answers), index=offset + i)
            )
        timing = {"generate": 0.0, "search": 0.0}
        lockstep = sync.num_processes > 1

        for turn in range(cfg.max_turns):
            active = [t for t in trajectories if not t.done]
            room = max((cfg.max_completion_tokens - len(t.completion_ids) for t in active), default=0)
            state = sync.turn(len(active), min(cfg.max_new_tokens, room))
            if not state.active:
                break
            last_turn = turn == cfg.max_turns - 1
            budget = [cfg.max_completion_tokens - len(t.completion_ids) for t in active]
            started = time.perf_counter()
            contexts = [t.prompt_ids + t.completion_ids for t in active]
            if not lockstep:
                outputs = generator.generate(contexts, max(1, state.budget))
            elif active:
                outputs = generator.generate(contexts, max(1, state.budget), width=state.width)
            else:  # done early: still take part in the turn's collectives
                outputs = []
                generator.idle(max(1, state.budget))
            timing["generate"] += time.perf_counter() - started

            searching: list[tuple[Trajectory, str]] = []
            calling: list[
                tuple[Trajectory, list, bool]
            ] = []  # protocol=tools: (trajectory, its calls, closed)
            for traj, gen, room in zip(active, outputs, budget, strict=True):
                if len(gen.token_ids) > room:  # the batch shared the largest budget; clip to this row's
                    gen = Generation(gen.token_ids[:room], gen.logprobs[:room], "length")
                traj.add_policy(gen)
                traj.turns += 1
                if self.tool_tokens is not None:
                    calls = self._tools_turn(traj, gen, last_turn)
                    if calls:
                        calling.append((traj, calls, gen.finish == "eos"))
                    continue
                kind, content = parse_action(self.tokenizer.decode(gen.token_ids, skip_special_tokens=True))
                if kind == "answer":
                    traj.answer, traj.finish = content, "answer"
                elif kind == "search" and not last_turn:
                    searching.append((traj, content))
                else:
                    traj.invalid_actions += kind == "invalid"
                    if last_turn:
                        traj.finish = "no_answer"
                    elif gen.finish == "eos":
                        traj.finish = "eos"
                    else:
                        traj.add_environment(self.tokens.invalid)
                if not traj.done and len(traj.completion_ids) >= cfg.max_completion_tokens:
                    traj.finish = "max_tokens"
            searching = [(t, q) for t, q in searching if not t.done]
            calling = [c for c in calling if not c[0].done]
            if self.tool_tokens is not None and (calling or lockstep):
                started = time.perf_counter()
                self._call_tools(calling, step)
                timing["search"] += time.perf_counter() - started
            elif searching or lockstep:  # every rank calls the engine each turn, possibly with nothing
                started = time.perf_counter()
                self._search(searching, step)
                timing["search"] += time.perf_counter() - started
        for traj in trajectories:
            # Observations may push a trajectory over the cap; the cap is on the whole completion.
            cap = cfg.max_completion_tokens
            del traj.completion_ids[cap:], traj.env_mask[cap:], traj.logprobs[cap:]
            traj.finish = traj.finish or "no_answer"
            if (
                traj.finish == "answer"
                and traj.completion_ids[-1] not in self.eos_ids
                and len(traj.env_mask) < cap
            ):
                # Generation stopped at </answer>, before the turn's EOS. Close the turn (masked, never trained)
                # so the trainer sees a finished sequence rather than a truncated one.
                traj.add_environment(self.eos_ids[:1])
        if self.step_rewards is not None:
            gain, redundancy = self.step_rewards
            for traj in trajectories:
                traj.step_rewards = search_step_rewards(
                    traj.search_docs, " ".join(traj.answers), gain_weight=gain, redundancy_weight=redundancy
                )
        return trajectories, timing

    def _search(self, searching: list[tuple[Trajectory, str]], step: int) -> None:
        for (traj, _), docs in zip(searching, self._run_searches(searching, step), strict=True):
            traj.add_environment(self.tokens.observation(docs))
            if len(traj.completion_ids) >= self.config.max_completion_tokens:
                traj.finish = "max_tokens"

    def _run_searches(self, searching: list[tuple[Trajectory, str]], step: int) -> list[list[Document]]:
        """One engine call for every search of the turn; each trajectory's counters and events updated. A
        trajectory's searches are numbered in order (the curriculum's draws: search number), several in a turn
        included."""
        numbers: list[int] = []
        seen: Counter = Counter()
        for t, _ in searching:
            numbers.append(t.searches + seen[id(t)])
            seen[id(t)] += 1
        requests = [
            SearchRequest(
                query=q,
                question=t.question,
                answers=t.answers,
                noise=None if self.noise is None else self.noise(step, t.index, n),
                source=None if self.source is None else self.source(step, t.index, n),
            )
            for (t, q), n in zip(searching, numbers, strict=True)
        ]
        results = self.engine.search(requests, self.k)
        if len(results) != len(requests):
            raise SearchError(f"search engine answered {len(results)} results for {len(requests)} requests")
        out = []
        for (traj, query), request, docs in zip(searching, requests, results, strict=True):
            if not docs and not self.empty_answers:
                raise SearchError(f"search engine returned no documents for query {query!r}")
            traj.searches += 1
            traj.search_close.append(len(traj.completion_ids) - 1)  # the token that closed the search's turn
            traj.search_docs.append(list(docs))
            traj.documents += len(docs)
            traj.noisy_documents += sum(d.noisy is True for d in docs)
            traj.retrieved.extend(docs)
            event: dict[str, Any] = {"query": query, "noisy": [d.noisy for d in docs]}
            if request.source is not None:
                traj.sources.append(request.source)
                event["source"] = request.source
            traj.events.append(event)
            out.append(list(docs))
        return out

    # -- protocol=tools ------------------------------------------------------------------------------------
    def _tools_turn(self, traj: Trajectory, gen: Generation, last_turn: bool) -> list:
        """Read a turn under the tools protocol: its calls (executed by :meth:`_call_tools`), or its answer, or
        an invalid turn. A turn's calls after the trajectory's budget are invalid (``over_budget``)."""
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        calls = parse_tool_calls(text, self.offered)
        if not calls:
            answer = extract_answer(text)
            if answer is not None:
                traj.answer, traj.finish = answer, "answer"
                return []
            traj.invalid_actions += 1
            traj.invalid_calls["no_action"] += 1
            if last_turn:
                traj.finish = "no_answer"
            else:
                close = [] if gen.finish == "eos" else [self.tool_tokens.eos_id]
                traj.add_environment(close + self.tool_tokens.correction(NO_ACTION))
                if len(traj.completion_ids) >= self.config.max_completion_tokens:
                    traj.finish = "max_tokens"
            return []
        budgeted = []
        for call in calls:
            traj.tool_calls += 1
            if not isinstance(call, InvalidCall) and traj.tool_calls > self.config.max_tool_calls:
                call = InvalidCall(
                    "over_budget",
                    f"this answer may call tools {self.config.max_tool_calls} times (rollout.max_tool_calls); "
                    "give the answer now",
                    call.name,
                )
            elif (
                isinstance(call, ToolCall)
                and call.name == "read_page"
                and call.arguments["doc"] > len(traj.results)
            ):
                shown = len(traj.results)
                call = InvalidCall(
                    "no_such_result",
                    f"there is no Doc {call.arguments['doc']}: "
                    + (f"the results so far are Doc 1 to Doc {shown}" if shown else "search first")
                    + " (a page opens a result of an earlier turn)",
                    call.name,
                )
            budgeted.append(call)
        if any(isinstance(c, InvalidCall) for c in budgeted):
            traj.invalid_actions += 1
            traj.invalid_calls.update(c.kind for c in budgeted if isinstance(c, InvalidCall))
        if last_turn:  # no turn left to read the replies in
            traj.finish = "no_answer"
            return []
        return budgeted

    def _call_tools(self, calling: list[tuple[Trajectory, list, bool]], step: int) -> None:
        """Run every valid call of the turn (one executor call per tool, over all trajectories), then give each
        trajectory its replies in its calls' order — an invalid call's reply says why — as the template renders
        them (masked)."""
        replies: dict[tuple[int, int], str] = {}
        for name in self.offered:
            batch = [
                (traj, i, call)
                for traj, calls, _ in calling
                for i, call in enumerate(calls)
                if not isinstance(call, InvalidCall) and call.name == name
            ]
            if batch or name == "search":  # search every turn: a rank of a lockstep run calls its engine too
                texts = getattr(self, f"execute_{name}")([(t, c) for t, _, c in batch], step)
                replies.update({(id(t), i): text for (t, i, _), text in zip(batch, texts, strict=True)})
        for traj, calls, closed in calling:
            parts = [
                (c.name or "error", f"Error: {c.reason}")
                if isinstance(c, InvalidCall)
                else (c.name, replies[(id(traj), i)])
                for i, c in enumerate(calls)
            ]
            traj.add_environment(
                ([] if closed else [self.tool_tokens.eos_id]) + self.tool_tokens.reply(parts)
            )
            if len(traj.completion_ids) >= self.config.max_completion_tokens:
                traj.finish = "max_tokens"

    def execute_search(self, calls: list[tuple[Trajectory, Any]], step: int) -> list[str]:
        """The ``search`` tool: the engine's documents for each query, formatted as under tags, clipped to
        ``rollout.max_obs_tokens``."""
        shown = {id(t): len(t.results) for t, _ in calls}  # results before this turn's searches
        docs = self._run_searches([(t, c.arguments["query"].strip()) for t, c in calls], step)
        out = []
        for (t, _), d in zip(calls, docs, strict=True):
            # with read_page offered, results are numbered across the trajectory: Doc n is what it opens
            start = shown[id(t)] + 1 if self.pages is not None else 1
            shown[id(t)] += len(d)
            out.append(self.tool_tokens.clip(format_documents(d, start=start)))
        return out

    def execute_read_page(self, calls: list[tuple[Trajectory, Any]], step: int) -> list[str]:
        """The ``read_page`` tool: the page of result ``doc`` (numbered across the trajectory's searches), from
        the engine's pages (:mod:`zerosim.core.pages`), noisy under the simulator as the curriculum draws for
        the trajectory's n-th page; clipped to ``rollout.max_page_tokens``."""
        from zerosim.core.pages import PageRequest

        if not calls:
            return []
        page_draw = getattr(self.noise, "page", None)
        opened: Counter = Counter()
        requests = []
        for t, c in calls:
            n = t.pages + opened[id(t)]
            opened[id(t)] += 1
            requests.append(
                PageRequest(
                    document=t.results[int(c.arguments["doc"]) - 1],
                    question=t.question,
                    answers=t.answers,
                    noisy=None if page_draw is None else page_draw(step, t.index, n),
                )
            )
        pages = self.pages.read_pages(requests, page_words(self.config))
        if len(pages) != len(requests):
            raise SearchError(f"the page reader answered {len(pages)} pages for {len(requests)} requests")
        out = []
        for (t, c), page in zip(calls, pages, strict=True):
            if not page.text.strip():
                raise SearchError(f"the page of result {c.arguments['doc']} ({page.title!r}) came back empty")
            t.pages += 1
            t.noisy_pages += page.noisy is True
            t.events.append({"page": c.arguments["doc"], "title": page.title, "noisy": page.noisy})
            out.append(self.tool_tokens.clip(page_text(page), self.config.max_page_tokens))
        return out

    # -- reporting -----------------------------------------------------------------------------------------
    def metrics(
        self, trajectories: Sequence[Trajectory], step: int, timing: Mapping[str, float]
    ) -> dict[str, float]:
        n = max(len(trajectories), 1)
        documents = sum(t.documents for t in trajectories)
        return {
            "search/noisy_doc_share": sum(t.noisy_documents for t in trajectories) / documents
            if documents
            else 0.0,
            "rollout/searches_per_traj": sum(t.searches for t in trajectories) / n,
            "rollout/turns_per_traj": sum(t.turns for t in trajectories) / n,
            "rollout/valid_format_rate": sum(t.valid_format for t in trajectories) / n,
            "rollout/answer_rate": sum(t.answer is not None for t in trajectories) / n,
            "rollout/em": sum(exact_match(t.answer, t.answers) for t in trajectories if t.answer) / n,
            "rollout/f1": sum(f1_score(t.answer, t.answers) for t in trajectories if t.answer) / n,
            "rollout/answer_echo_rate": sum(answer_echoes_question(t) for t in trajectories) / n,
            "rollout/invalid_action_rate": sum(t.invalid_actions > 0 for t in trajectories) / n,
            "rollout/policy_tokens_per_traj": sum(sum(t.env_mask) for t in trajectories) / n,
            "time/generate_s": timing.get("generate", 0.0),
            "time/search_s": timing.get("search", 0.0),
            **(
                {"rollout/step_reward_per_traj": sum(sum(t.step_rewards) for t in trajectories) / n}
                if self.step_rewards is not None
                else {}
            ),
            **(self.tool_metrics(trajectories) if self.tool_tokens is not None else {}),
            **engine_counters(self.engine),
            **(self.source_metrics(trajectories) if self.source is not None else {}),
            **(self.step_metrics(step) if self.step_metrics is not None else {}),
        }

    def tool_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """``tools/*``: calls per trajectory, the share of them that were invalid, and each invalid kind's count
        over the step (every kind, 0 included, so curves are continuous)."""
        n = max(len(trajectories), 1)
        calls = sum(t.tool_calls for t in trajectories)
        invalid = Counter()
        for t in trajectories:
            invalid.update(t.invalid_calls)
        call_kinds = sum(v for k, v in invalid.items() if k != "no_action")
        return {
            "tools/calls_per_traj": calls / n,
            "tools/invalid_call_share": call_kinds / calls if calls else 0.0,
            **{f"tools/invalid/{kind}": float(invalid[kind]) for kind in INVALID_KINDS},
            **(self.page_metrics(trajectories) if self.pages is not None else {}),
        }

    @staticmethod
    def page_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """``tools/pages_per_traj`` and, of the pages opened, the share the simulator wrote noisy."""
        pages = sum(t.pages for t in trajectories)
        return {
            "tools/pages_per_traj": pages / max(len(trajectories), 1),
            "search/noisy_page_share": sum(t.noisy_pages for t in trajectories) / pages if pages else 0.0,
        }

    def source_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """``mixed/*`` (each search's source drawn by ``source``): the share of searches the real retriever
        answered, and per source group of trajectories (``real``, ``sim``, ``both``, ``none``: see
        :attr:`Trajectory.source_group`) its share of the trajectories, EM, F1 (a missing answer counts 0)
        and searches per trajectory. A group absent from the step has no keys (not 0)."""
        out: dict[str, float] = {}
        searches = sum(len(t.sources) for t in trajectories)
        if searches:
            real = sum(s == "real" for t in trajectories for s in t.sources)
            out["mixed/real_search_share"] = real / searches
        for group in SOURCE_GROUPS:
            members = [t for t in trajectories if t.source_group == group]
            if not members:
                continue
            n = len(members)
            out[f"mixed/{group}/share"] = n / len(trajectories)
            out[f"mixed/{group}/em"] = sum(exact_match(t.answer, t.answers) for t in members if t.answer) / n
            out[f"mixed/{group}/f1"] = sum(f1_score(t.answer, t.answers) for t in members if t.answer) / n
            out[f"mixed/{group}/searches"] = sum(t.searches for t in members) / n
        return out


def engine_counters(engine: Any) -> dict[str, float]:
    """The running counters of a search engine and the engines it wraps, as ``search/<name>/<counter>``.

    ``<name>`` is the name an engine with ``stats`` declares as ``metrics_name`` (``CachedSearchEngine``:
    ``search/cache/hits``…, ``LLMSimulator``: ``search/simulator/noisy_leaks``…); counters are cumulative
    since the start of the process.
    """
    out: dict[str, float] = {}
    for layer in engine_layers(engine):  # the wrappers the rollout builds, and both parts of a mixed engine
        stats = getattr(layer, "stats", None)
        if isinstance(stats, Mapping):
            name = getattr(layer, "metrics_name", None)
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"{type(layer).__name__} keeps stats but declares no metrics_name: give the class one "
                    f'(e.g. metrics_name = "{type(layer).__name__.lower()}"), its counters are logged as '
                    "search/<metrics_name>/<counter>"
                )
            out.update({f"search/{name}/{key}": float(value) for key, value in stats.items()})
    return out


def synced_decoding(model, sync) -> bool:
    """Whether transformers ``generate`` will synchronise decoding steps across ranks (``synced_gpus``)."""
    if sync.num_processes < 2:
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


ECHO_F1 = 0.8  # an answer at least this close (token F1) to the question restates it


def answer_echoes_question(traj: Trajectory) -> bool:
    """The answer restates the question (token F1 ≥ ``ECHO_F1``): a format reward pays for it like any
    wrong answer, and a policy without an answer signal can drift into writing it every time."""
    return bool(traj.answer) and f1_score(traj.answer, [traj.question]) >= ECHO_F1
