"""Load FlashRAG QA datasets and passage corpora, checking every row.

QA rows are ``{"id", "question", "golden_answers", "metadata"}`` (FlashRAG's format) or Search-R1's training
rows (``data_source``, ``prompt`` as chat messages, ``reward_model.ground_truth.target``, ``extra_info``);
corpus rows are ``{"id", "contents": "Title\\ntext"}``. Files may be ``.jsonl`` or ``.parquet``; where a QA
source is named by a spec (a FlashRAG folder ``DIR:nq:test``, a hub dataset ``REPO:NAME:SPLIT``) is
:mod:`zerosim.core.data.spec`'s business. A bad row raises :class:`DataError` naming the file, the 1-based line (or
row) and the field. Every loader applies the same row checks: a row whose gold answers are all empty after
:func:`~zerosim.core.metrics.normalize_answer` (``[""]``, ``["the"]``) is refused (every prediction would
score 0 on it), and so is a data set that repeats a question id (ids are compared as text, so ``1`` and
``"1"`` are one id; scores are paired by id) — except a file merging data sets whose ids repeat only across
them (Search-R1's ``nq_hotpotqa_train``), whose ids are qualified by ``data_source`` (``nq/train_0``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerosim.core.data.jsonl import DataError, at_line, iter_jsonl
from zerosim.core.data.spec import FORMS, QASpec, parse_qa_spec
from zerosim.core.metrics import normalize_answer
from zerosim.core.search import Document

SEARCH_R1_QUESTION = "Question:"  # Search-R1's make_prefix template ends with "Question: {question}\n"


@dataclass(frozen=True)
class QAExample:
    """One question with its accepted answers; ``metadata`` is free-form (FlashRAG's ``metadata``)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    metadata: dict = field(default_factory=dict, hash=False, compare=False)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _plain(value: Any) -> Any:
    """A numpy array or scalar (what pandas reads from parquet) as a Python list or value."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str | bytes) else value


def _got(row: dict, name: str) -> str:
    """What a bad field holds, for error messages: ``missing``, ``empty str``, ``int`` ..."""
    if name not in row:
        return "missing"
    value = row[name]
    empty = isinstance(value, str | list | tuple) and not (value.strip() if isinstance(value, str) else value)
    return f"empty {_type_name(value)}" if empty else _type_name(value)


def _rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of a ``.jsonl`` or ``.parquet`` file; ``where`` reads ``"f.jsonl line 7"``."""
    if not path.is_file():
        raise DataError(f"{path}: no such file; check the path (a FlashRAG .jsonl or .parquet file)")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy: only parquet users pay the import

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DataError(f"{path}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{path} row {i}", row
        return
    for i, row in iter_jsonl(path):
        yield at_line(path, i), row


def _object(where: str, row: Any) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: each row must be a JSON object (got {_type_name(row)})")
    return row


def _id(where: str, row: dict) -> str:
    value = row.get("id")
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise DataError(
            f"{where}: field 'id' must be a non-empty string or an integer (got {_got(row, 'id')})"
        )
    return str(value)


def _text(where: str, row: dict, name: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field {name!r} must be a non-empty string (got {_got(row, name)})")
    return value


def scorable_answers(where: str, answers: tuple[str, ...], name: str) -> tuple[str, ...]:
    """``answers`` (a row's gold answers, read from its field ``name``) when at least one survives
    :func:`~zerosim.core.metrics.normalize_answer` — the check every QA loader applies. A row whose answers
    all normalise to nothing (``""``, ``"the"``, ``"?"``) can never be matched: every prediction scores 0 on
    it, so it is refused rather than scored."""
    if any(normalize_answer(a) for a in answers):
        return answers
    shown = repr(list(answers))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise DataError(
        f"{where}: field {name!r} holds no answer that survives answer normalisation (got {shown}; case, "
        "punctuation, the articles a/an/the and whitespace are dropped before scoring, so every prediction "
        "would score 0 on this row); give the row a real answer or drop the row"
    )


def _answers(where: str, row: dict) -> tuple[str, ...]:
    value = _plain(row.get("golden_answers"))
    if isinstance(value, str):  # some datasets store a single answer as a plain string
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        got = _got(row, "golden_answers")
    elif bad := [a for a in value if not isinstance(a, str)]:
        got = f"an item of type {_type_name(bad[0])}"
    else:
        return scorable_answers(where, tuple(value), "golden_answers")
    raise DataError(f"{where}: field 'golden_answers' must be a non-empty list of strings (got {got})")


def _search_r1_question(where: str, row: dict) -> str:
    """The ``question`` column when there is one (Search-R1's nq_search files keep FlashRAG's), else the text
    after the last ``Question:`` of the prompt's last user message."""
    question = row.get("question")
    if isinstance(question, str) and question.strip():
        return question.strip()
    prompt = _plain(row.get("prompt"))
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1].get("content") if users else None
    if not isinstance(text, str):
        raise DataError(
            f"{where}: field 'prompt' must be chat messages with a user message (got {_got(row, 'prompt')}); "
            'Search-R1 rows read [{"role": "user", "content": "... Question: <question>"}], or add a '
            "'question' column"
        )
    at = text.rfind(SEARCH_R1_QUESTION)
    if at < 0 or not text[at + len(SEARCH_R1_QUESTION) :].strip():
        raise DataError(
            f"{where}: the prompt's user message has no 'Question: <question>' to take the question from "
            "(Search-R1's template ends with it); add a 'question' column holding the question"
        )
    return text[at + len(SEARCH_R1_QUESTION) :].strip()


def _search_r1_answers(where: str, row: dict) -> tuple[str, ...]:
    reward_model = _plain(row.get("reward_model"))
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    target = _plain(truth.get("target")) if isinstance(truth, dict) else None
    if isinstance(target, str):
        target = [target]
    if isinstance(target, list) and target and all(isinstance(a, str) for a in target):
        return scorable_answers(where, tuple(target), "reward_model.ground_truth.target")
    got = "missing" if target is None else f"{_type_name(target)} {target!r}"[:80]
    raise DataError(
        f"{where}: field 'reward_model.ground_truth.target' must be a non-empty list of answer strings (got "
        f'{got}); Search-R1 rows read {{"reward_model": {{"ground_truth": {{"target": ["answer", ...]}}}}}}'
    )


def _search_r1_id(where: str, row: dict, index: int | None) -> str:
    if row.get("id") not in (None, ""):  # FlashRAG's id, which Search-R1's nq_search files keep
        return _id(where, row)
    extra = _plain(row.get("extra_info"))
    value = _plain(extra.get("index")) if isinstance(extra, dict) else None
    if isinstance(value, str | int) and not isinstance(value, bool) and value != "":
        return str(value)
    if index is None:
        raise DataError(f"{where}: no 'id' and no 'extra_info.index'; add an 'id' field")
    return str(index)


def _parse_search_r1_row(where: str, row: dict, index: int | None) -> QAExample:
    """A Search-R1 training row: question from ``question`` or the prompt, answers from
    ``reward_model.ground_truth.target``, id from ``id``, ``extra_info.index`` or the 0-based row number."""
    metadata = _plain(row.get("metadata"))
    metadata = dict(metadata) if isinstance(metadata, dict) else {}
    for key in ("data_source", "ability", "extra_info"):
        if row.get(key) is not None:
            metadata[key] = _plain(row[key])
    return QAExample(
        id=_search_r1_id(where, row, index),
        question=_search_r1_question(where, row),
        golden_answers=_search_r1_answers(where, row),
        metadata=metadata,
    )


def parse_qa_row(where: str, row: Any, index: int | None = None) -> QAExample:
    """Check one QA row and build a :class:`QAExample`; ``where`` prefixes any error message. A row with
    ``reward_model`` is read as Search-R1's (``index``, the 0-based row number, is its id of last resort);
    any other as FlashRAG's."""
    row = _object(where, row)
    if "reward_model" in row:
        return _parse_search_r1_row(where, row, index)
    metadata = _plain(row.get("metadata"))
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DataError(f"{where}: field 'metadata' must be an object (got {_type_name(metadata)})")
    return QAExample(
        id=_id(where, row),
        question=_text(where, row, "question"),
        golden_answers=_answers(where, row),
        metadata=metadata,
    )


def local_path(source: str | Path, split: str | None) -> Path | None:
    """The file ``source`` names, if it names a local one (a file, ``<dir>/<split>.jsonl|.parquet``, a
    FlashRAG folder's ``DIR:NAME:SPLIT``); ``None`` for a hub dataset (:func:`zerosim.core.data.spec.parse_qa_spec`).
    """
    return parse_qa_spec(source, split).path


def _hub_rows(spec: QASpec) -> Iterator[tuple[str, Any]]:
    import datasets  # lazy: heavy, and only hub users need it

    args = (spec.repo, spec.config) if spec.config else (spec.repo,)
    try:
        data = datasets.load_dataset(*args, split=spec.split)
    except (ValueError, OSError) as e:  # no such dataset, config or split; no hub access (offline)
        shown = ", ".join(map(repr, args)) + f", split={spec.split!r}"
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise DataError(
            f"{spec.text}: datasets.load_dataset({shown}) failed ({reason}); {spec.repo} is no local folder "
            f"either; {FORMS}"
        ) from None
    if isinstance(data, datasets.DatasetDict):
        raise DataError(f"{spec.text}: pass split= (one of {sorted(data)})")
    for i, row in enumerate(data, start=1):
        yield f"{spec.where} row {i}", row


def load_qa(source: str | Path, split: str | None = None, limit: int | None = None) -> list[QAExample]:
    """Read QA rows (FlashRAG's or Search-R1's) from a ``.jsonl``/``.parquet`` file, a folder holding
    ``<split>.jsonl``, a FlashRAG folder (``DIR:nq:test`` → ``DIR/nq/test.jsonl``) or a Hugging Face dataset
    (``REPO:NAME:SPLIT`` → ``datasets.load_dataset(REPO, NAME, split=SPLIT)``; ``REPO`` alone uses ``split``;
    needs hub access). The forms: :mod:`zerosim.core.data.spec`.

    ``split`` is the default split: a split in the spec wins; it is ignored for a file path. ``limit`` keeps
    the first ``limit`` rows. A bad row raises :class:`DataError` naming file, line and field.
    """
    spec = parse_qa_spec(source, split)
    rows = _rows(spec.path) if spec.path is not None else _hub_rows(spec)
    examples, wheres = [], []
    for index, (where, row) in enumerate(rows):
        if limit is not None and len(examples) >= limit:
            break
        examples.append(parse_qa_row(where, row, index))
        wheres.append(where)
    return check_unique_ids(examples, wheres)


def _by_source(examples: list[QAExample]) -> list[QAExample] | None:
    """A file merging data sets (Search-R1's ``nq_hotpotqa_train``: each set's rows keep their own ids, so
    ``train_0`` is in both) with each id qualified by its row's ``data_source`` (``nq/train_0``), when that
    makes every id unique; None when some row has no source or ids still repeat within one source."""
    sources = [ex.metadata.get("data_source") for ex in examples]
    if not all(isinstance(s, str) and s for s in sources) or len(set(sources)) < 2:
        return None
    qualified = [
        dataclasses.replace(ex, id=f"{src}/{ex.id}") for ex, src in zip(examples, sources, strict=True)
    ]
    return qualified if len({ex.id for ex in qualified}) == len(qualified) else None


def check_unique_ids(examples: list[QAExample], wheres: list[str]) -> list[QAExample]:
    """``examples`` when no two (read at ``wheres``: ``"f.jsonl line 7"``) share an id; a file merging data
    sets whose ids repeat only across sets gets its ids qualified by ``data_source`` (:func:`_by_source`);
    otherwise :class:`DataError` naming the id and both rows. Ids are compared as the loaders hold them, as
    text (``1`` and ``"1"`` are one id); evaluation writes one score per id and the experiment's report pairs
    questions by id, so a repeated id would merge two questions into one."""
    seen: dict[str, int] = {}
    repeats = []
    for i, ex in enumerate(examples):
        if ex.id in seen:
            repeats.append((seen[ex.id], i))
        else:
            seen[ex.id] = i
    if not repeats:
        return examples
    qualified = _by_source(examples)
    if qualified is not None:
        return qualified
    first, second = repeats[0]
    there = " ".join(wheres[first].rsplit(" ", 2)[-2:])  # "line 3" / "row 3"
    more = f" ({len(repeats) - 1} more repeated id(s) after it)" if len(repeats) > 1 else ""
    raise DataError(
        f"{wheres[second]}: question id {examples[second].id!r} repeats the id of {there}{more}; question ids "
        'must be unique within a data set (compared as text, so 1 and "1" are one id; scores are paired by '
        f"id): give each question its own id or drop the duplicate"
    )


def sample_examples(examples: list[QAExample], n: int, *, seed: int, by: str = "hops") -> list[QAExample]:
    """``n`` of ``examples`` drawn at random (seeded), each ``metadata[by]`` stratum keeping its share (scikit-
    learn's stratified split), in their original order; all of them when ``n`` covers them. Rows without
    ``metadata[by]``, or strata too small to split, are sampled without stratification."""
    if n >= len(examples):
        return list(examples)
    from sklearn.model_selection import train_test_split

    strata = [ex.metadata.get(by) for ex in examples]
    counts = Counter(strata)
    splittable = min(counts.values()) >= 2 and len(counts) <= min(n, len(examples) - n)
    stratify = strata if None not in counts and splittable else None
    index = list(range(len(examples)))
    kept, _ = train_test_split(index, train_size=n, random_state=seed, stratify=stratify)
    return [examples[i] for i in sorted(kept)]


def load_corpus(path: str | Path) -> list[Document]:
    """Read a FlashRAG corpus (``{"id", "contents": "Title\\ntext"}`` per row; ``.jsonl`` or ``.parquet``)."""
    docs = []
    for where, row in _rows(Path(path)):
        row = _object(where, row)
        docs.append(Document.from_contents(_id(where, row), _text(where, row, "contents")))
    return docs
