"""Stage keys, and what a stage's record says about whether to run it again.

Every stage is keyed by a fingerprint of its inputs: its job's settings that differ from their defaults, the
version of those defaults, the experiment root written as ``<root>``, and the keys of the stages it reads
from — so a release that adds a setting at a neutral default re-runs nothing. Where a stage is logged
(``tracking``) is left out, so moving the MLflow store or naming another experiment re-runs nothing either.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerosim.core.config import flatten
from zerosim.experiment.kinds import KINDS, Kind, Stage, read_stage
from zerosim.experiment.provenance import written_digest

# A stage's key holds only the settings that differ from their schema's defaults, so a release that adds a
# setting at a default that changes nothing does not re-run finished stages. A release that changes a default
# changes what a stage computes without changing those settings: it bumps this version, which every key holds.
# tests/test_experiment.py pins the defaults (tests/snapshots/stage_key_defaults.json) and fails on any change
# until the snapshot is rewritten, with the version bumped where a changed default changes results.
KEY_DEFAULTS_VERSION = 1
UNSET = "<unset>"  # a default's setting that a config lacks (a removed dict entry)

# Settings whose default changed without changing what any stage computes (so KEY_DEFAULTS_VERSION stayed):
# a record holding a former default reads as today's default. Keyed by a setting's path or the end of it (a
# section nested in another matches too).
FORMER_DEFAULTS: dict[str, tuple[Any, ...]] = {
    # unset takes a given index's own encoder and minilm for an index built here: what "minilm" (the former
    # default) ran, since a given index with another encoder refused it
    "search.dense.encoder": ("minilm",),
}


def stage_schemas() -> dict[Kind, type]:
    """The schema each stage kind's job reads (the kinds with a config)."""
    return {kind: spec.schema for kind, spec in KINDS.items() if spec.schema is not None}


def _leaves(config: Any) -> dict[str, Any]:
    """``{"trainer.learning_rate": 1e-06, ...}``: a config's leaves (:func:`zerosim.core.config.flatten`) as plain
    JSON values, so enums, tuples and paths compare as they are written."""
    return {k: json.loads(json.dumps(v, default=str)) for k, v in flatten(config).items()}


@functools.cache
def schema_defaults(schema: type) -> dict[str, Any]:
    """Every setting of a job's schema at its default, as dotted leaves."""
    return _leaves(schema())


def changed_settings(config: Any, schema: type, *, missing: Any = UNSET) -> dict[str, Any]:
    """The leaves of ``config`` that differ from ``schema``'s defaults (where runs are logged left out); a
    default's setting that ``config`` lacks counts as ``missing`` (``None``: as at its default)."""
    current, defaults = _leaves(config), schema_defaults(schema)
    changed = {k: v for k, v in current.items() if k not in defaults or defaults[k] != v}
    if missing is not None:
        changed.update({k: missing for k in defaults if k not in current})
    return {k: v for k, v in changed.items() if not k.startswith("tracking.")}


def _keyed(kind: str, changes: dict[str, Any]) -> dict[str, Any]:
    """The changed settings a kind's result depends on (:attr:`StageKind.keyed_on`; all where it names none) —
    a warm start keyed by its own settings, not by the RL recipe it shares a config with."""
    reads = KINDS[kind].keyed_on
    if not reads:
        return changes
    return {
        k: v for k, v in changes.items() if any(k.startswith(r) if r.endswith(".") else k == r for r in reads)
    }


def _live(kind: str, changes: dict[str, Any], schema: type) -> dict[str, Any]:
    """``changes`` (a kind's keyed changed settings) less those its result cannot depend on given the rest
    (:attr:`StageKind.inert`: the seed of a greedy evaluation of every question), read over the schema's
    defaults — so a record and today's config that differ only there get one key."""
    rule = KINDS[kind].inert
    if rule is None:
        return changes
    inert = rule({**schema_defaults(schema), **changes})
    return {k: v for k, v in changes.items() if k not in inert}


def fingerprint(stage: Stage, root: Path, keys: dict[str, str]) -> str:
    """The stage's key: what its result depends on — its settings that differ from their defaults (those its
    kind reads and it can depend on), the version of those defaults, and the keys of the stages it reads
    (``keys``: by name)."""
    schema = KINDS[stage.kind].schema
    changes = None if stage.config is None else _keyed(stage.kind, changed_settings(stage.config, schema))
    config = None if changes is None else _live(stage.kind, changes, schema)
    return _key(stage.kind, config, stage.meta, {d: keys[d] for d in stage.deps}, root)


def _key(
    kind: str, config: dict[str, Any] | None, meta: dict[str, Any], deps: dict[str, str], root: Path
) -> str:
    payload = {"kind": kind, "defaults": KEY_DEFAULTS_VERSION, "config": config, "meta": meta, "deps": deps}
    text = json.dumps(payload, sort_keys=True, default=str).replace(str(root), "<root>")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _former_default(path: str, value: Any) -> bool:
    return any(
        (path == name or path.endswith("." + name)) and value in former
        for name, former in FORMER_DEFAULTS.items()
    )


def _recorded_changes(recorded: dict[str, Any], schema: type) -> dict[str, Any]:
    """:func:`changed_settings` of a stage record's config (``stage.json``), read by today's schema: a setting
    the record lacks was added since, and the stage ran as at its default; a former default that computes
    what today's does (:data:`FORMER_DEFAULTS`) reads as today's."""
    return {
        k: v for k, v in changed_settings(recorded, schema, missing=None).items() if not _former_default(k, v)
    }


def _same_weights(dep: str, dep_done: dict[str, Any], done: dict[str, Any]) -> bool:
    """``dep``'s record holds a model with the digest ``done`` records having read from it."""
    wrote = written_digest(dep_done)
    return wrote is not None and (done.get("reads") or {}).get(dep) == wrote


def recorded_key(stage: Stage, done: dict[str, Any], root: Path, stages: dict[str, Stage]) -> str | None:
    """The key today's rules give what a finished stage ran — its recorded config and meta, and the records of
    the stages it read, each finished before it — or None where the records cannot tell.

    A record keeps the key of the rules it was written under; when the rules change (a new way to key
    stages), :func:`status` still reuses a stage whose record shows the work that would run now."""
    config = done.get("config")
    if stage.config is not None and not isinstance(config, dict):
        return None
    deps: dict[str, str] = {}
    for name in stage.deps:
        dep = stages.get(name)
        dep_done = None if dep is None else read_stage(dep, root)
        # the record this stage read: a dependency finished after it was re-run since — which changes
        # nothing where it wrote the very weights this stage's record says it read (a model re-made under
        # the same key on the same CPU kind, as :func:`~zerosim.experiment.provenance.provenance` reuses)
        if dep_done is None or (
            str(dep_done.get("finished", "~")) > str(done.get("finished", ""))
            and not _same_weights(name, dep_done, done)
        ):
            return None
        key = dep_done.get("key")
        if key != dep.key:
            key = recorded_key(dep, dep_done, root, stages)
        if key is None:
            return None
        deps[name] = key
    schema = KINDS[stage.kind].schema
    changes = None if stage.config is None else _keyed(stage.kind, _recorded_changes(config, schema))
    changes = None if changes is None else _live(stage.kind, changes, schema)
    return _key(stage.kind, changes, done.get("meta", {}), deps, root)


def status(stage: Stage, root: Path, stages: Sequence[Stage] = ()) -> str:
    """``reuse`` (finished with this key, or its record shows the same work: :func:`recorded_key`, which reads
    the records of ``stages``), ``run`` (never finished), ``re-run`` (finished with other work), ``continue``
    (a training stage killed after a checkpoint)."""
    done = read_stage(stage, root)
    if done is not None:
        if done.get("key") == stage.key:
            return "reuse"
        same = recorded_key(stage, done, root, {s.name: s for s in stages}) == stage.key
        return "reuse" if same else "re-run"
    if stage.kind == Kind.train and any(stage.dir(root).glob("*/checkpoint-*/")):
        return "continue"
    return "run"
