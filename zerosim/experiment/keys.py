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


# -- what a stage computes in: the CPU precision decided, not the setting --------------------------------------
# ``runtime.bf16`` (null: the update in bf16 where the CPU multiplies it in hardware, generation in fp32; true: both
# in bf16) and ``trainer.bf16`` (null: as the runtime decides the update, unless the loss compares two passes) decide
# per machine what a stage computes in. Its key holds the decision instead: ``runtime.bf16: hi+lo`` where generation
# runs in bf16 (:data:`BF16_GENERATION`) and ``trainer.bf16: true`` where the update does, nothing where they run
# fp32 (what every key held before these settings decided anything but AMX updates). A record is read by the rules
# of its time on its machine: one without ``runtime.bf16`` generated in fp32 and updated in bf16 only on AMX with
# trainer.bf16 auto and beta 0; one of :data:`ONE_WEIGHT_BF16_COMMITS` generated in bf16 under auto too. So the
# presets that pin runtime.bf16=false keep their exported records' keys.
PRECISION_KINDS = frozenset(
    {Kind.train, Kind.eval, Kind.quality}
)  # the kinds whose generation or update it sets
PRECISION_SETTINGS = ("runtime.bf16", "trainer.bf16")
# bf16 generation computes with each linear weight as hi + lo (zerosim.core.bf16) since the commit after these;
# their records generated from one bf16 weight per layer (a fine-tune mostly rounded away): their key says
# ``runtime.bf16: true``, today's ``runtime.bf16: hi+lo``, so none of theirs is reused for what runs now.
ONE_WEIGHT_BF16_COMMITS = ("a0eaf1e", "b15186a", "a0f2013", "e790be8")
BF16_GENERATION = "hi+lo"


def _units_of(machine: str | None) -> str | None:
    """The bf16 matrix instructions a record's ``machine`` (:func:`zerosim.core.runtime.cpu_kind`) names."""
    machine = machine or ""
    if "AMX" in machine.replace("no AMX", ""):
        return "AMX"
    return "AVX512_BF16" if "with bf16" in machine else None


def _with_precision(
    kind: str,
    changes: dict[str, Any],
    leaves: dict[str, Any],
    machine: str | None,
    *,
    recorded: bool,
    commit: str | None = None,
) -> dict[str, Any]:
    """``changes`` with the precision settings replaced by what they decide on ``machine`` (see above): ``leaves``
    is the stage's whole config (defaults filled in), ``recorded`` a record's (read by the rules of its time),
    ``commit`` the code a record ran (:data:`ONE_WEIGHT_BF16_COMMITS`)."""
    from zerosim.core.runtime import decide_precision

    if machine is not None and "CUDA" in machine:
        return changes  # a GPU computes in the recipe's precision: the settings as they are
    out = {k: v for k, v in changes.items() if k not in PRECISION_SETTINGS}
    if kind not in PRECISION_KINDS:
        return out
    predates = recorded and "runtime.bf16" not in leaves
    if machine is None and not predates:  # a record that does not say where it ran: here
        machine = _this_machine()
    units = _units_of(machine)
    decided = decide_precision(leaves.get("runtime.bf16"), units)
    one_weight = recorded and str(commit or "").startswith(ONE_WEIGHT_BF16_COMMITS)
    # that code generated in bf16 under auto too; today's generates in fp32 unless runtime.bf16=true
    generation = False if predates else decided.bf16 if one_weight else decided.generation
    update = leaves.get("trainer.bf16")
    if kind == Kind.train and update is None:
        compares = leaves.get("trainer.beta", 0) != 0
        # before runtime.bf16, auto updated in bf16 on AMX only (unknown machine: as its key held, fp32)
        update = (units == "AMX" if predates else decided.bf16) and not compares
    if generation:
        out["runtime.bf16"] = True if one_weight else BF16_GENERATION
    if kind == Kind.train and update:
        out["trainer.bf16"] = True
    return out


def _this_machine() -> str:
    from zerosim.experiment.provenance import machine_kind

    return machine_kind()


def fingerprint(stage: Stage, root: Path, keys: dict[str, str]) -> str:
    """The stage's key: what its result depends on — its settings that differ from their defaults (those its
    kind reads and it can depend on), the version of those defaults, and the keys of the stages it reads
    (``keys``: by name)."""
    schema = KINDS[stage.kind].schema
    config = None
    if stage.config is not None:
        changes = _keyed(stage.kind, changed_settings(stage.config, schema))
        leaves = {**schema_defaults(schema), **_leaves(stage.config)}
        changes = _with_precision(stage.kind, changes, leaves, _this_machine(), recorded=False)
        config = _live(stage.kind, changes, schema)
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
    changes = None
    if stage.config is not None:
        changes = _keyed(stage.kind, _recorded_changes(config, schema))
        leaves = {**schema_defaults(schema), **_leaves(config)}
        leaves = {k: v for k, v in leaves.items() if k != "runtime.bf16" or k in _leaves(config)}
        code = done.get("code")
        commit = code.get("commit") if isinstance(code, dict) else None
        changes = _with_precision(
            stage.kind, changes, leaves, done.get("machine"), recorded=True, commit=commit
        )
        changes = _live(stage.kind, changes, schema)
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
