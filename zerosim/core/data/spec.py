"""Where a QA data set comes from, named by one string: a file, a folder, a FlashRAG folder or a hub dataset.

The forms, tried in this order (``DIR`` may contain ``:``; ``NAME`` and ``SPLIT`` may not):

- ``PATH``: an existing ``.jsonl``/``.parquet`` file, or a folder holding ``<split>.jsonl|.parquet``. A path
  that exists always wins over the forms below (a POSIX path may contain ``:``).
- ``DIR:NAME:SPLIT``: a FlashRAG folder (one folder per data set, files named after their split):
  ``DIR/NAME/SPLIT.jsonl`` (or ``.parquet``). ``DIR:NAME`` takes the split from the caller when ``DIR/NAME``
  is a folder; ``DIR:SPLIT`` is ``DIR/SPLIT.jsonl``.
- ``REPO:NAME:SPLIT``: a Hugging Face dataset with a config name, ``datasets.load_dataset(REPO, NAME,
  split=SPLIT)`` (``RUC-NLPIR/FlashRAG_datasets:nq:test``); ``REPO:SPLIT`` and ``REPO`` have no config.

A split written in the spec wins over the caller's (``data.split``, eval's ``split``). In a list of data sets
(eval's ``datasets``), ``SOURCE:NAME+NAME+...:SPLIT`` stands for one ``SOURCE:NAME:SPLIT`` per name
(:func:`expand_qa_specs`). A spec that fits no form raises :class:`DataError` naming it, what was tried and
the forms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zerosim.core.data.jsonl import DataError

FILE_SUFFIXES = (".jsonl", ".parquet")
_NAME = re.compile(r"[A-Za-z0-9_][\w.+-]*\Z")  # a data set / config name or a split: no '/' nor ':'
_REPO = re.compile(r"[A-Za-z0-9_][\w.-]*(/[\w.-]+)?\Z")  # a hub id: "name" or "org/name"

FORMS = (
    "expected a .jsonl/.parquet file, a folder DIR holding <split>.jsonl, DIR:NAME:SPLIT for a FlashRAG folder "
    "(DIR/NAME/SPLIT.jsonl), or REPO:NAME:SPLIT for a Hugging Face dataset with a config "
    "(e.g. RUC-NLPIR/FlashRAG_datasets:nq:test; REPO or REPO:SPLIT without one)"
)


@dataclass(frozen=True)
class QASpec:
    """A parsed spec: a local ``path`` (``repo`` None) or a hub dataset ``repo`` with ``config``/``split``."""

    text: str  # the spec as written, for messages
    path: Path | None = None  # the file to read (may not exist: reported when read)
    repo: str | None = None
    config: str | None = None  # FlashRAG data set / hub config name ("nq"); None for a plain file or folder
    split: str | None = None

    @property
    def where(self) -> str:
        """How rows of this source are named in errors: the file, or ``repo [config, split]``."""
        if self.path is not None:
            return str(self.path)
        return f"{self.repo} [{', '.join(p for p in (self.config, self.split) if p)}]"


def _path_like(text: str) -> bool:
    """A string that can only mean a path (never a hub id): reported as a missing file or folder."""
    return text.startswith(("/", ".", "~")) or text.endswith((*FILE_SUFFIXES, ".json"))


def _names(text: str) -> bool:
    return bool(_NAME.match(text)) and not text.endswith((*FILE_SUFFIXES, ".json"))


def _listing(folder: Path, dirs: bool) -> str:
    found = sorted(p.name for p in folder.iterdir() if (p.is_dir() if dirs else p.suffix in FILE_SUFFIXES))
    shown = ", ".join(found[:20]) + (", ..." if len(found) > 20 else "")
    return (
        f"its {'folders' if dirs else 'files'}: {shown}"
        if found
        else f"it holds no {'folders' if dirs else 'data files'}"
    )


def split_file(folder: Path, split: str | None, spec: str | None = None) -> Path:
    """``folder/<split>.jsonl`` or ``.parquet``; a missing split names what the folder holds."""
    about = f"{spec}: " if spec else ""
    if split is None:
        raise DataError(f"{about}{folder} is a folder: pass split= to pick {folder}/<split>.jsonl")
    for suffix in FILE_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return folder / f"{split}{suffix}"
    raise DataError(
        f"{about}{folder}: no {split}.jsonl or {split}.parquet in this folder ({_listing(folder, dirs=False)}); "
        "pick a split it has"
    )


def _flashrag(spec: str, root: Path, name: str, split: str | None) -> QASpec:
    folder = root / name
    if not folder.is_dir():
        raise DataError(
            f"{spec}: {root} has no folder {name!r} (tried {folder}; {_listing(root, dirs=True)}); a FlashRAG "
            "folder holds one folder per data set: DIR/NAME/SPLIT.jsonl"
        )
    return QASpec(spec, path=split_file(folder, split, spec), config=name, split=split)


def named_qa_spec(text: str) -> tuple[str, str, str] | None:
    """``(source, name, split)`` when ``text`` reads ``SOURCE:NAME:SPLIT`` (and is no existing path): a FlashRAG
    folder's or a hub config's data set, named ``name`` in tables and MLflow. Reads no file."""
    if Path(text).expanduser().exists():
        return None
    parts = text.rsplit(":", 2)
    if len(parts) == 3 and parts[0] and _names(parts[1]) and _names(parts[2]):
        return parts[0], parts[1], parts[2]
    return None


def parse_qa_spec(source: str | Path, split: str | None = None) -> QASpec:
    """Resolve ``source`` (see the module doc) with ``split`` as the caller's default split.

    Local folders are looked at (a folder spec resolves to its file; a missing folder, data set or split
    raises :class:`DataError`); a hub spec is only parsed here, its rows are read by ``load_qa``.
    """
    text = str(source)
    path = Path(text).expanduser()
    if isinstance(source, Path) or path.exists() or ":" not in text:
        if path.is_dir():
            return QASpec(text, path=split_file(path, split), split=split)
        if isinstance(source, Path) or path.exists() or _path_like(text):
            return QASpec(text, path=path, split=split)  # a missing file is reported when it is read
        if _REPO.match(text):
            return QASpec(text, repo=text, split=split)
        raise DataError(f"{text}: no such file or folder, and not a Hugging Face dataset id; {FORMS}")
    named = named_qa_spec(text)
    if named and "+" in named[1]:
        raise DataError(
            f"{text} names several data sets ({named[1].replace('+', ', ')}); this setting reads one: name one "
            "(eval's datasets list takes SOURCE:NAME+NAME:SPLIT and evaluates each)"
        )
    head, _, last = text.rpartition(":")
    tried = []
    if named:  # DIR:NAME:SPLIT
        root = Path(named[0]).expanduser()
        if root.is_dir():
            return _flashrag(text, root, named[1], named[2])
        tried.append(f"{named[0]} as a FlashRAG folder (no such folder)")
    elif _names(last):  # DIR:NAME (the caller's split) or DIR:SPLIT
        root = Path(head).expanduser()
        if root.is_dir():
            if (root / last).is_dir():
                return _flashrag(text, root, last, split)
            return QASpec(text, path=split_file(root, last, text), split=last)
        tried.append(f"{head} as a folder (no such folder)")
    repo = named[0] if named else head
    if (named or _names(last)) and not _path_like(repo) and _REPO.match(repo):
        if named:
            return QASpec(text, repo=repo, config=named[1], split=named[2])
        return QASpec(text, repo=repo, split=last)
    if not _path_like(repo):
        tried.append(f"{repo} as a Hugging Face id (ids read name or org/name)")
    tried.append(f"{text} as a file (no such file)")
    raise DataError(f"{text}: not a data set I can find (tried {'; '.join(tried)}); {FORMS}")


def expand_qa_specs(specs: list[str]) -> list[str]:
    """``SOURCE:NAME+NAME+...:SPLIT`` → one ``SOURCE:NAME:SPLIT`` per name; other specs are kept as written."""
    out = []
    for spec in specs:
        named = named_qa_spec(spec)
        if named is None or "+" not in named[1]:
            out.append(spec)
            continue
        head, names, split = named
        if not all(_names(n) for n in names.split("+")):
            raise DataError(f"{spec}: an empty name in {names!r}; join names with single '+' (nq+hotpotqa)")
        out.extend(f"{head}:{name}:{split}" for name in names.split("+"))
    return out


def embedded_split(source: str | None, split: str, default: str, data_key: str, split_key: str) -> str | None:
    """The embedded factbook's split that ``factbook:SPLIT`` (``source``) names, read as ``zerosim eval
    --dataset`` reads it; None for any other source (``factbook`` alone included: ``split`` applies).

    A single-dataset setting (``data.train`` with ``data.split``, ``warmstart.data``, ``validation.data``,
    the simulator jobs' ``data``) takes the spec's split when its split setting holds its default
    (``default``); another value there names a second split, and the two are refused, naming both keys. An
    unknown split is refused with the splits there are. A file that exists under that very name stays a file.
    """
    from zerosim.core.config import EMBEDDED_DATA, ConfigError

    if not source or not source.startswith(f"{EMBEDDED_DATA}:") or Path(source).expanduser().exists():
        return None
    named = source.split(":", 1)[1]
    from zerosim.core.data.splits import SPLITS

    if named not in SPLITS:
        raise ConfigError(
            f"{data_key}={source}: the embedded factbook has splits {', '.join(SPLITS)}, not {named!r}; "
            f"write {EMBEDDED_DATA}:SPLIT with one of them"
        )
    if split not in (default, named):
        raise ConfigError(
            f"{data_key}={source} names split {named}, and {split_key}={split} another: give the split once, "
            f"either {data_key}={EMBEDDED_DATA}:{split} or {data_key}={EMBEDDED_DATA} {split_key}={named} "
            f"(or {split_key}={default}, its default, to take {named})"
        )
    return named


def resolve_embedded(node: object, data_field: str, prefix: str, split_field: str = "split") -> None:
    """A config's ``factbook:SPLIT`` written as the run reads it: ``data_field`` becomes ``factbook`` and
    ``split_field`` the spec's split (:func:`embedded_split` refuses a conflict), so every dry run, the run
    and the config it logs agree. Called by the schemas' ``validate``."""
    from dataclasses import fields

    from zerosim.core.config import EMBEDDED_DATA

    default = next(f.default for f in fields(node) if f.name == split_field)
    source, split = getattr(node, data_field), getattr(node, split_field)
    named = embedded_split(source, split, default, f"{prefix}{data_field}", f"{prefix}{split_field}")
    if named is not None:
        setattr(node, data_field, EMBEDDED_DATA)
        setattr(node, split_field, named)
