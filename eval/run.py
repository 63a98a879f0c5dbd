"""``zerosim eval``: load the policy, the engine and the datasets, evaluate, write the table, log to MLflow."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eval.config import HarnessConfig, Sample
from eval.harness import (
    DatasetResult,
    Evaluator,
    empty_dataset_error,
    generation_backend,
    load_policy,
    markdown_table,
    release_policy,
    table,
)
from zerosim.core.config import ConfigError
from zerosim.core.data.embedded import load_questions
from zerosim.core.data.jsonl import write_jsonl
from zerosim.core.data.qa import sample_examples
from zerosim.core.data.spec import expand_qa_specs, named_qa_spec, parse_qa_spec
from zerosim.core.fsutil import atomic_write_text, check_output_folder
from zerosim.core.search import SearchEngine, ledgers
from zerosim.core.tracking import check_tracking_uri, link_eval_table, log_config, log_jsonl, mlflow_run


@dataclass
class EvalResult:
    run_id: str
    rows: list[dict[str, Any]]
    markdown: str
    out_dir: Path
    ledger: list[dict[str, Any]] = field(default_factory=list)  # paid engines' requests and cost (web search)


FILE_SUFFIXES = (".jsonl", ".parquet")
# file stems that name a split, not a dataset: nq/test.jsonl is named after its folder ("nq")
SPLIT_NAMES = frozenset({"train", "dev", "test", "val", "valid", "validation", "eval", "evaluation"})


def _file_name(path: Path, default_split: str, depth: int = 1) -> str:
    """A dataset file's display name: its stem, or — when the stem is a split name — its folder's name
    (plus ``:<split>`` for a split other than ``default_split``). ``depth`` > 1 prefixes that many more
    parent folders (``a/nq`` vs ``b/nq``)."""
    folders = [p for p in path.resolve().parent.parts if p != path.anchor and p != "/"]
    stem = path.stem
    if stem.lower() in SPLIT_NAMES and folders:
        base = "/".join(folders[-depth:])
        return base if stem == default_split else f"{base}:{stem}"
    prefix = folders[-(depth - 1) :] if depth > 1 else []
    return "/".join([*prefix, stem])


def parse_dataset(spec: str, default_split: str) -> tuple[str, str, str]:
    """``"factbook:dev"`` → (display name, source, split). A bare name uses ``default_split``.

    A file is named by its stem (``data/nq.jsonl`` → ``nq``), or by its folder when the stem is a split name
    (``nq/test.jsonl`` → ``nq``, ``nq/dev.jsonl`` → ``nq:dev``); :func:`dataset_names` makes names distinct.
    A FlashRAG folder's or a hub dataset's ``SOURCE:NAME:SPLIT`` is named ``NAME`` (``DIR:nq:test`` → ``nq``,
    ``...:nq:dev`` → ``nq:dev``) and passed on whole (``load_qa`` reads it). An existing path is a file.
    """
    if named := named_qa_spec(spec):
        _, name, split = named
        return (name if split == default_split else f"{name}:{split}"), spec, split
    source, sep, split = spec.rpartition(":")
    if source and (Path(source).expanduser() / split).is_dir() and not Path(spec).expanduser().exists():
        return split, spec, default_split  # DIR:NAME, a FlashRAG folder's data set at the default split
    if not sep or "/" in split or split.endswith(FILE_SUFFIXES) or Path(spec).expanduser().exists():
        source, split = spec, default_split
    if source.endswith(FILE_SUFFIXES):
        return _file_name(Path(source), default_split), source, split
    return (f"{source}:{split}" if split != default_split else source), source, split


def _dataset_key(source: str, split: str) -> tuple[str, str]:
    """What makes two specs the same dataset: the file read (``DIR:nq:test`` is ``DIR/nq/test.jsonl``)."""
    try:
        path = parse_qa_spec(source, split).path  # None: a hub dataset
    except ValueError:  # DataError: a missing folder or split, reported when the dataset is read
        path = Path(source) if source.endswith(FILE_SUFFIXES) else None
    return (str(path.resolve()), "") if path is not None else (source, split)


def _named_longer(source: str, depth: int, default_split: str) -> str:
    """A ``SOURCE:NAME:SPLIT`` dataset's name with ``depth - 1`` trailing parts of SOURCE before it."""
    head, name, split = named_qa_spec(source)
    local = Path(head).expanduser()
    parts = [p for p in (local.resolve().parts if local.is_dir() else head.split("/")) if p not in ("/", "")]
    base = "/".join([*parts[max(0, len(parts) - (depth - 1)) :], name])
    return base if split == default_split else f"{base}:{split}"


def dataset_names(specs: list[str], default_split: str) -> list[tuple[str, str, str]]:
    """``(name, source, split)`` per spec, the names distinct: each names a table row and the MLflow metrics
    ``<name>/<metric>``. Files whose names collide are told apart by their parent folders (``a/nq``,
    ``b/nq``), ``SOURCE:NAME:SPLIT`` datasets by SOURCE's; a dataset listed twice, or one that cannot be told
    apart, is a :class:`ConfigError`. ``SOURCE:NAME+NAME:SPLIT`` stands for one dataset per name."""
    specs = expand_qa_specs(list(specs))
    parsed = [parse_dataset(spec, default_split) for spec in specs]
    keys: dict[tuple[str, str], str] = {}
    for spec, (_, source, split) in zip(specs, parsed, strict=True):
        key = _dataset_key(source, split)
        if key in keys:
            raise ConfigError(
                f"datasets lists the same dataset twice ({keys[key]!r} and {spec!r}); list it once"
            )
        keys[key] = spec
    names = [name for name, _, _ in parsed]
    depth = [1] * len(parsed)
    while True:
        clash = {n for n in names if names.count(n) > 1}
        if not clash:
            break
        deeper = False
        for i, (_, source, _) in enumerate(parsed):
            if names[i] in clash and (source.endswith(FILE_SUFFIXES) or named_qa_spec(source)):
                depth[i] += 1
                if named_qa_spec(source):
                    longer = _named_longer(source, depth[i], default_split)
                else:
                    longer = _file_name(Path(source), default_split, depth[i])
                deeper |= longer != names[i]
                names[i] = longer
        if not deeper:
            shown = ", ".join(s for s, n in zip(specs, names, strict=True) if n in clash)
            raise ConfigError(
                f"datasets {shown} all get the name {sorted(clash)[0]!r}; rename a file or its folder"
            )
    if "average" in names:
        raise ConfigError("a dataset may not be named 'average' (the table's average row); rename its file")
    return [(name, source, split) for name, (_, source, split) in zip(names, parsed, strict=True)]


def run_name(cfg: HarnessConfig) -> str:
    """The eval run's name and folder under ``output_dir``: ``run_name``, else ``<method>-<engine>``."""
    return cfg.run_name or f"{cfg.method}-{'none' if cfg.method == 'direct' else cfg.search.engine}"


def load_datasets(cfg: HarnessConfig) -> list[tuple[str, list]]:
    """``(name, rows)`` per dataset of ``cfg``, every one non-empty; raises before any model is loaded."""
    if cfg.limit is not None and cfg.limit < 1:
        raise ConfigError(
            f"limit={cfg.limit} would evaluate no rows; set limit to a number of rows >= 1, or leave it unset "
            "(null) to evaluate every row"
        )
    if cfg.batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1 (questions per generation batch), got {cfg.batch_size}")
    if not cfg.datasets:
        raise ConfigError("datasets is empty; name at least one (a file, an HF id, or factbook)")
    loaded = []
    for name, source, split in dataset_names(list(cfg.datasets), cfg.split):
        if cfg.limit is not None and cfg.sample == Sample.stratified:
            rows = sample_examples(load_questions(source, split), cfg.limit, seed=cfg.seed)
        else:
            rows = load_questions(source, split, limit=cfg.limit)
        if not rows:
            where = source if source.endswith(FILE_SUFFIXES) else f"{source}, split {split}"
            raise empty_dataset_error(name, where)
        loaded.append((name, rows))
    return loaded


def _training_run_of(policy_path: str) -> str | None:
    """The MLflow run whose final checkpoint is ``policy_path``, when it is in the same store."""
    import mlflow

    path = Path(policy_path)
    if not path.exists():
        return None
    runs = mlflow.search_runs(
        search_all_experiments=True,
        filter_string=f"tags.`zerosim.checkpoint` = '{path.resolve()}'",
        output_format="list",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def run_eval(
    cfg: HarnessConfig, *, build_engine: Callable[..., SearchEngine] | None = None, progress: bool = True
) -> EvalResult:
    """Evaluate ``cfg.policy`` (``cfg``: the harness fields and ``search``, ``zerosim.job_config.EvalConfig``);
    the search engine (every method but ``direct``) comes from
    ``build_engine(cfg.search, seed=cfg.seed, dtype=cfg.dtype)`` — the app's factory,
    :func:`zerosim.engines.build_search_engine` — called once the datasets and the policy have loaded."""
    import torch

    from zerosim.core.models import load_tokenizer

    torch.manual_seed(cfg.seed)
    check_tracking_uri(cfg.tracking.tracking_uri)  # the MLflow store it will write, before any work
    loaded = load_datasets(cfg)  # every dataset read and checked before a model loads
    check_output_folder(Path(cfg.output_dir) / run_name(cfg), "output_dir")  # and the folder it writes
    if cfg.method != "direct" and build_engine is None:
        raise TypeError(f"method {cfg.method} needs build_engine= (zerosim.engines.build_search_engine)")
    from zerosim.core.fsutil import folder_lock

    with folder_lock(Path(cfg.output_dir) / run_name(cfg), "zerosim eval"):  # one evaluation per folder
        tokenizer = load_tokenizer(cfg.policy)
        evaluator = _evaluator(cfg, tokenizer, build_engine)
        # closed however the run ends, and held by nothing after: a frame kept past its end (any traceback
        # kept from under it holds it) would keep a vLLM engine, which the next eval stage in this process
        # needs room for
        try:
            return _evaluate(cfg, evaluator, loaded, progress)
        finally:
            evaluator.close()
            del evaluator


def _evaluator(cfg: HarnessConfig, tokenizer, build_engine: Callable[..., SearchEngine] | None) -> Evaluator:
    """The policy loaded (by generation: a transformers model, a vLLM engine, the policy server), then the
    search engine built, in an :class:`Evaluator` that releases the policy when closed; released here if the
    engine or the evaluator fails."""
    model = load_policy(cfg)
    try:
        engine = None if cfg.method == "direct" else build_engine(cfg.search, seed=cfg.seed, dtype=cfg.dtype)
        return Evaluator(cfg, model, tokenizer, engine)
    except BaseException:
        release_policy(model, generation_backend(cfg))
        raise
    finally:
        del model  # the evaluator holds it now; this frame must not, should it outlive its call


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _evaluate(
    cfg: HarnessConfig, evaluator: Evaluator, loaded: list[tuple[str, list]], progress: bool
) -> EvalResult:
    """Every dataset of ``loaded`` evaluated in one MLflow run; the table and every question's scores written
    to ``<output_dir>/<run name>`` and logged."""
    import mlflow

    engine_name = "none" if cfg.method == "direct" else cfg.search.engine
    name = run_name(cfg)
    out_dir = Path(cfg.output_dir) / name
    out_dir.mkdir(parents=True, exist_ok=True)

    tags = {"zerosim.job": "eval", "zerosim.policy": cfg.policy, "zerosim.method": cfg.method}
    with mlflow_run(cfg.tracking, name, tags=tags) as run:
        train_run = _training_run_of(cfg.policy)
        if train_run:
            mlflow.set_tag("zerosim.train_run_id", train_run)
        if evaluator.answers_shown:  # the explicit override search.simulator.pass_answers=true
            mlflow.set_tag("zerosim.simulator_sees_answers", "eval")
        log_config(cfg)
        results: list[DatasetResult] = [evaluator.evaluate(name, rows, progress) for name, rows in loaded]
        rows = table(results)
        title = f"{cfg.method} · search={engine_name} · policy={cfg.policy}"
        md = markdown_table(rows, title)
        spent = [] if evaluator.engine is None else ledgers(evaluator.engine)
        if spent:  # what a paid engine (web search) was asked, and its estimated cost, under the table
            from eval.web import describe_ledger

            md += "\n" + "\n".join(describe_ledger(entry) for entry in spent) + "\n"
            for entry in spent:
                mlflow.log_metrics({f"search/web/{k}": float(v) for k, v in entry.items() if _number(v)})
            mlflow.log_text(json.dumps(spent, indent=2), "search_ledger.json")
            atomic_write_text(out_dir / "search_ledger.json", json.dumps(spent, indent=2))
        for row in rows:
            prefix = row["dataset"].replace(":", "_")  # MLflow metric names allow no colon
            mlflow.log_metrics({f"{prefix}/{k}": v for k, v in row.items() if k != "dataset" and v == v})
        samples = [
            {"dataset": r.name, **asdict(row)}
            for r in results
            for row in r.rows[: cfg.num_sample_trajectories]
        ]
        # every question's scores (what paired comparisons of two policies on the same questions need) and
        # its answer, so a surprising score can be read without the MLflow store
        questions = [
            {
                "dataset": r.name,
                "id": row.id,
                "em": row.em,
                "f1": row.f1,
                "cover_em": row.cover_em,
                "prediction": row.prediction,
                "tagged": row.tagged,
            }
            for r in results
            for row in r.rows
        ]
        write_jsonl(out_dir / "questions.jsonl", questions)
        atomic_write_text(out_dir / "table.json", json.dumps(rows, indent=2, sort_keys=True))
        atomic_write_text(out_dir / "table.md", md)
        mlflow.log_text(json.dumps(rows, indent=2, sort_keys=True), "table.json")
        mlflow.log_text(md, "table.md")
        log_jsonl(samples, "samples/trajectories.jsonl")
        if train_run:  # the training run (and the model it logged) point at this table
            link_eval_table(train_run, run.info.run_id)
        return EvalResult(run.info.run_id, rows, md, out_dir, ledger=spent)
