"""Cold start: supervised fine-tuning of the policy on synthetic search trajectories.

A small instruct model prompted with the tag protocol never emits ``<search>`` or ``<answer>`` (measured
on SmolLM2-135M-Instruct: 0 of 16 samples), so RL from zero reward learns nothing. Warm-starting on a few
hundred synthetic trajectories — think, search with a real retriever, read, think, answer — teaches the
protocol. With ``grounded`` (the default) only trajectories whose ``<information>`` block, as the policy sees
it after clipping, holds a gold answer are kept, and that answer is the one written: the policy learns to
read its answer from the documents rather than to write a gold answer it was never shown (which teaches
confident guessing). The trajectories are built from the *same* token pieces the RL rollout uses (prompt, observation
block), and the ``<information>`` tokens are masked out of the SFT loss exactly as they are in RL.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path

from zerosim.agent.rollout import ProtocolTokens, build_prompt
from zerosim.core.data.qa import QAExample
from zerosim.core.fsutil import atomic_directory
from zerosim.core.search import SearchEngine, SearchRequest
from zerosim.training.config import WarmstartConfig

IGNORE_INDEX = -100  # label value the loss skips

_THINK_BEFORE = (
    "I need to find {topic}. Let me search for it.",
    "I am not sure about {topic}, so I will search.",
    "To answer, I should look up {topic}.",
)
_THINK_OPEN = (
    "Doc {doc} may say more. Let me read its page.",
    "I will open Doc {doc} to read the whole page.",
)
_THINK_AFTER = (
    "The documents say the answer is {answer}.",
    "According to the information, it is {answer}.",
    "From the search results, the answer is {answer}.",
)


def _topic(question: str) -> str:
    q = question.strip().rstrip("?").strip()
    return q[0].lower() + q[1:] if q else q


def _open_page(ex, docs, pages, tool_tokens, rollout, tokenizer):
    """``(result number, the read_page reply's tokens, the gold answers it holds)`` for the first of ``docs`` whose
    page, clipped as the rollout clips it, holds a gold answer; None where none does."""
    from zerosim.agent.rollout import page_text, page_words
    from zerosim.core.metrics import answer_in_text
    from zerosim.core.pages import PageRequest

    for i, page in enumerate(
        pages.read_pages([PageRequest(document=d) for d in docs], page_words(rollout)), 1
    ):
        text = tool_tokens.clip(page_text(page), rollout.max_page_tokens)
        found = [a for a in ex.golden_answers if answer_in_text(text, [a])]
        if found:
            return i, tool_tokens.reply([("read_page", text)]), found
    return None


def build_examples(
    questions: Sequence[QAExample],
    engine: SearchEngine,
    tokenizer,
    *,
    k: int,
    max_obs_tokens: int,
    seed: int = 0,
    batch_size: int = 64,
    grounded: bool = False,
    limit: int | None = None,
    rollout=None,
    pages=None,
) -> list[dict[str, list[int]]]:
    """Tokenised trajectories with ``labels`` = ``IGNORE_INDEX`` on the prompt and on every observation token.

    ``grounded``: skip questions whose clipped observation holds no gold answer. ``limit``: stop after that
    many trajectories. ``rollout`` (a :class:`~zerosim.agent.rollout.RolloutConfig`): under
    ``protocol=tools`` the trajectories are written as the RL rollout reads them there — the search as a
    ``<tool_call>`` closing the turn, the documents as the template's ``tool`` message, the answer in the
    last turn — from :class:`~zerosim.agent.tool_format.ToolTokens`' pieces. With ``read_page`` offered (and
    ``rollout.max_turns`` >= 3; ``pages``: the engine's, :mod:`zerosim.core.pages`), a trajectory opens the page
    of the first result whose page holds a gold answer when no result's text does, and half of the others (a
    seeded draw) open it too: search, read, answer.
    """
    from zerosim.agent.rollout import Protocol
    from zerosim.core.metrics import answer_in_text

    rng = random.Random(seed)
    tokens = ProtocolTokens(tokenizer, max_obs_tokens)
    tool_tokens = None
    if rollout is not None and rollout.protocol == Protocol.tools:
        from zerosim.agent.tool_format import ToolTokens
        from zerosim.agent.tools import tools_named

        tool_tokens = ToolTokens(tokenizer, tools_named(rollout.tools), max_obs_tokens)
    reading = tool_tokens is not None and "read_page" in rollout.tools and rollout.max_turns >= 3
    if reading and pages is None:
        raise ValueError("build_examples: read_page demonstrations need the engine's pages (pages=)")
    rows: list[dict[str, list[int]]] = []
    for start in range(0, len(questions), batch_size):
        if limit is not None and len(rows) >= limit:
            break
        batch = questions[start : start + batch_size]
        results = engine.search([SearchRequest(query=q.question) for q in batch], k)
        for ex, docs in zip(batch, results, strict=True):
            if limit is not None and len(rows) >= limit:
                break
            answer = ex.golden_answers[0]
            if tool_tokens is not None:
                from zerosim.core.search import format_documents

                observation = tool_tokens.reply([("search", tool_tokens.clip(format_documents(docs)))])
            else:
                observation = tokens.observation(docs)
            seen = tokenizer.decode(observation, skip_special_tokens=True)
            found = [a for a in ex.golden_answers if answer_in_text(seen, [a])]
            opened = None  # read_page: (result number, the page's reply tokens, answers it holds)
            if reading and (not found or rng.random() < 0.5):
                opened = _open_page(ex, docs, pages, tool_tokens, rollout, tokenizer)
                if opened is not None:
                    found = opened[2]
            if grounded:
                if not found:
                    continue
                answer = found[0]
            think = f"<think>{rng.choice(_THINK_BEFORE).format(topic=_topic(ex.question))}</think>\n"
            second = f"<think>{rng.choice(_THINK_AFTER).format(answer=answer)}</think>\n<answer> {answer} </answer>"
            # (tokens, trained): the policy's turns are learnt, the prompt and every tool reply masked
            if tool_tokens is not None:  # the call as the template writes an assistant's tool_calls
                call = json.dumps({"name": "search", "arguments": {"query": ex.question.strip()}})
                eot = [tool_tokens.eos_id]
                pieces = [
                    (tool_tokens.prompt(ex.question), False),
                    (tokens.encode(f"{think}<tool_call>\n{call}\n</tool_call>") + eot, True),
                    (observation, False),
                ]
                if opened is not None:  # search, then read the page, then answer
                    doc, page_reply, _ = opened
                    read = json.dumps({"name": "read_page", "arguments": {"doc": doc}})
                    think_open = f"<think>{rng.choice(_THINK_OPEN).format(doc=doc)}</think>\n"
                    pieces += [(tokens.encode(f"{think_open}<tool_call>\n{read}\n</tool_call>") + eot, True)]
                    pieces += [(page_reply, False)]
                pieces.append((tokens.encode(second) + eot, True))
            else:
                pieces = [
                    (tokens.prompt(build_prompt(ex.question)), False),
                    (tokens.encode(f"{think}<search> {ex.question.strip()} </search>"), True),
                    (observation, False),
                    (tokens.encode(second) + [tokenizer.eos_token_id], True),
                ]
            input_ids = [t for ids, _ in pieces for t in ids]
            labels = [t if trained else IGNORE_INDEX for ids, trained in pieces for t in ids]
            rows.append({"input_ids": input_ids, "labels": labels})
    return rows


def warmstart_folder(cfg) -> str:
    """``warmstart`` (tags), ``warmstart-tools`` (tools, search alone) or ``warmstart-tools-<tool>-…`` (other
    tools offered): a warm start written for another protocol or tool set is not reused."""
    from zerosim.agent.rollout import Protocol

    if cfg.rollout.protocol == Protocol.tags:
        return "warmstart"
    tools = list(cfg.rollout.tools)
    return "warmstart-tools" if tools == ["search"] else "-".join(["warmstart-tools", *tools])


def _pages(engine, search, rollout):
    """The engine's pages where the rollout offers read_page (its demonstrations open some), else None."""
    if rollout is None or rollout.protocol != "tools" or "read_page" not in rollout.tools:
        return None
    from zerosim.engines import reading_pages

    return reading_pages(engine, search, prefix="warmstart.search.")


def run_warmstart(cfg: WarmstartConfig, *, output_dir: Path, **kwargs) -> Path:
    """:func:`_run_warmstart` holding ``output_dir``: a second warm start into it is refused at once."""
    import os

    from zerosim.core.fsutil import folder_lock

    if os.environ.get("RANK", "0") != "0":
        return _run_warmstart(cfg, output_dir=output_dir, **kwargs)
    with folder_lock(output_dir, "zerosim policy warmstart"):
        return _run_warmstart(cfg, output_dir=output_dir, **kwargs)


def _run_warmstart(
    cfg: WarmstartConfig, *, policy: str, seed: int, tracking, output_dir: Path, engine=None, rollout=None
) -> Path:
    """SFT ``policy`` on synthetic trajectories; returns the checkpoint directory (an MLflow run is logged).
    ``rollout``: the RL rollout's settings, whose protocol the trajectories are written in (:func:`build_examples`)."""
    import mlflow
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from zerosim.core.data.embedded import load_questions
    from zerosim.core.models import load_causal_lm, load_tokenizer
    from zerosim.core.tracking import check_tracking_uri, log_config, mlflow_run
    from zerosim.engines import build_search_engine

    check_tracking_uri(tracking.tracking_uri)  # the MLflow store, tried before the policy loads
    questions = load_questions(cfg.data, cfg.split)
    rng = random.Random(seed)
    questions = rng.sample(questions, len(questions))  # a seeded order; built until num_examples are kept
    tokenizer = load_tokenizer(policy)
    if engine is None:
        engine = build_search_engine(cfg.search, seed=seed)
    rows = build_examples(
        questions,
        engine,
        tokenizer,
        k=cfg.search.k,
        max_obs_tokens=cfg.max_obs_tokens,
        seed=seed,
        grounded=cfg.grounded,
        limit=cfg.num_examples,
        rollout=rollout,
        pages=_pages(engine, cfg.search, rollout),
    )
    if not rows:
        raise ValueError(
            f"no warm-start trajectory: no question of {cfg.data} ({cfg.split}) had a gold answer in its "
            f"clipped search results; raise warmstart.max_obs_tokens or set warmstart.grounded=false"
        )
    model = load_causal_lm(policy, trained=True)  # fp32 weights: the SFT's optimizer steps them
    import torch

    on_gpu = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=str(output_dir / "trainer"),
        max_steps=cfg.max_steps,
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, cfg.max_steps // 10),
        logging_steps=1,
        save_strategy="no",
        report_to=["mlflow"],
        use_cpu=not on_gpu,
        bf16=on_gpu,
        seed=seed,
        max_length=None,
        gradient_checkpointing=cfg.gradient_checkpointing,  # TRL's default is on; on small models it costs time
        dataloader_num_workers=0,
    )
    target = output_dir / "final"
    with mlflow_run(tracking, f"{output_dir.parent.name}-warmstart", tags={"zerosim.job": "warmstart"}):
        log_config(cfg, prefix="warmstart.")
        mlflow.log_params({"warmstart.policy": policy, "warmstart.examples_built": len(rows)})
        from zerosim.training.precision import MasterWeightsCheck

        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[MasterWeightsCheck()],  # the optimizer steps fp32 weights (ZeRO/FSDP: their masters)
        )
        trainer.train()
        with atomic_directory(target) as tmp:
            trainer.save_model(str(tmp))
            tokenizer.save_pretrained(str(tmp))
        mlflow.set_tag("zerosim.checkpoint", str(target.resolve()))
        if tracking.log_model:  # the warm-start policy as the run's model (rl: false arms evaluate it)
            from zerosim.core.tracking import log_model

            log_model(target, name="policy")
    shutil.rmtree(output_dir / "trainer", ignore_errors=True)
    return target
