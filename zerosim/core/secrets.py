"""Secrets: API keys read from the environment, held so that nothing the project writes can hold them.

A config never holds a key: it names the environment variable that does (a field made with
:func:`zerosim.core.config.env_name`, which the loader checks is a variable's name and not a key pasted in).
The key itself is read once, into a :class:`Secret`, whose ``str`` and ``repr`` name the variable and never
show the value; only :meth:`Secret.reveal`, at the one place a request is built, gives it out. Every secret
read is remembered for the process, and from the first one on every log record is passed through
:func:`redact` (a log-record factory, so that no handler added later escapes it): a provider that echoes a key
in an error body, or a URL carrying one in its query string, is logged with ``***`` in its place. Error
messages built from what a server said go through :func:`redact` too (``eval.web``).
"""

from __future__ import annotations

import logging
import os
import re
import threading

from zerosim.core.config import ConfigError

ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")  # what env_name fields accept: an environment variable's name
MASK = "***"

_live: set[str] = set()  # every secret value read in this process
_lock = threading.Lock()
_factory_installed = False


class Secret:
    """A key read from environment variable ``name``: ``str()`` and ``repr()`` say ``$NAME``, never the value;
    it cannot be pickled (a copy in a checkpoint or a worker's arguments would be a copy on disk)."""

    __slots__ = ("_value", "name")

    def __init__(self, value: str, name: str):
        if not value:
            raise ValueError(f"the secret in ${name} is empty")
        self._value = value
        self.name = name
        _remember(value)

    def reveal(self) -> str:
        """The key itself: for the header or parameter of one request, nowhere else."""
        return self._value

    def __repr__(self) -> str:
        return f"Secret(${self.name})"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError(
            f"a Secret (${self.name}) is not pickled: read it from the environment where it is used"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("zerosim-secret", self.name))


def secret_from_env(name: str, key: str) -> Secret:
    """The secret in environment variable ``name`` (set by config key ``key``), or a :class:`ConfigError`
    naming the variable and the key when it is unset or empty."""
    value = os.environ.get(name, "")
    if not value.strip():
        raise ConfigError(
            f"{key}: the environment variable {name} is not set (or empty); export {name}=<your API key> "
            f"before the run, or name the variable that holds it with {key}=<VARIABLE>"
        )
    return Secret(value.strip(), name)


def redact(text: str) -> str:
    """``text`` with every secret read in this process replaced by ``***``."""
    with _lock:
        values = sorted(_live, key=len, reverse=True)
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


def _remember(value: str) -> None:
    global _factory_installed
    with _lock:
        _live.add(value)
        if _factory_installed:
            return
        _factory_installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not format: logging reports it as it would
            return record
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return record

    logging.setLogRecordFactory(factory)
