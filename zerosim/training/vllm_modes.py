"""``trainer.generation``'s vLLM modes checked before any weight loads, at start and in every dry run.

TRL runs vLLM inside each training process (``vllm_colocate``) or asks a ``trl vllm-serve`` server
(``vllm_server``); either way it pushes the policy's new weights into vLLM every step through a CUDA device, so
neither mode runs without one — TRL's weight sync raises ``NotImplementedError`` only once the models have
loaded. A server that does not answer is waited on (TRL's ``vllm_server_timeout``, 240 s), also after loading;
here it is asked once, with a short timeout.
"""

from __future__ import annotations

import importlib.util
import sys
import urllib.error
import urllib.request

import torch

from zerosim.core.config import ConfigError, check_url
from zerosim.training.config import TrainConfig

# seconds a vLLM server has to answer its health check
HEALTH_TIMEOUT_S = 5.0


def vllm_installed() -> bool:
    return "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None


def require_vllm(cfg: TrainConfig, *, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """A :class:`ConfigError` naming the key and the fix when ``trainer.generation`` asks for vLLM it cannot
    have: no CUDA device, no vLLM, or (``vllm_server``) no healthy server at ``trainer.vllm_server_url``."""
    generation = cfg.trainer.generation
    if generation == "hf":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.generation={generation} needs a CUDA GPU and none is visible here (TRL's vLLM weight sync "
            "runs on a CUDA device); use trainer.generation=hf on CPU"
        )
    if not vllm_installed():
        raise ConfigError(
            f"trainer.generation={generation} needs vLLM, which is not installed here; install it on "
            "a CUDA machine (pip install vllm, the version TRL supports) or use trainer.generation=hf"
        )
    if generation == "vllm_server":
        check_vllm_server(cfg.trainer.vllm_server_url, timeout=timeout)


def check_vllm_server(
    url: str, key: str = "trainer.vllm_server_url", *, timeout: float = HEALTH_TIMEOUT_S
) -> None:
    """A GET of ``url``'s ``/health`` (the route TRL's ``VLLMClient.check_server`` waits on) answered 200 within
    ``timeout`` seconds, else a :class:`ConfigError` naming ``key``."""
    health = check_url(url, key).rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout):  # noqa: S310 - an http(s) URL (check_url)
            return
    except urllib.error.HTTPError as exc:
        problem = f"{health} answered HTTP {exc.code}, not as `trl vllm-serve` does"
    except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timed out
        reason = getattr(exc, "reason", exc)
        problem = f"no answer within {timeout:g} s from {health} ({reason})"
    raise ConfigError(
        f"{key} {url}: {problem}; start `trl vllm-serve --model <policy>` there first, or set {key} to the "
        "server's address (or use trainer.generation=vllm_colocate)"
    )


def planned_generation(cfg: TrainConfig, gpu_memory: float | None = None) -> str:
    """The dry run's ``generation`` row, once :func:`require_vllm` passed here as it must at start. A plan for
    another machine's card (``gpu_memory`` GB given, no CUDA device here) leaves CUDA and vLLM to that machine;
    a ``vllm_server`` is asked all the same (its health route, :data:`HEALTH_TIMEOUT_S`): a dead URL passed the
    plan and stopped the run."""
    t = cfg.trainer
    if t.generation == "hf":
        return "hf"
    if gpu_memory is not None and not torch.cuda.is_available():
        elsewhere = f"for a CUDA GPU of {gpu_memory:g} GB elsewhere"
        if t.generation != "vllm_server":
            return f"{t.generation} ({elsewhere}: not checked here)"
        try:
            check_vllm_server(t.vllm_server_url)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (--gpu-memory plans for another machine's GPU, but the server is asked from here: run "
                "the dry run where the server answers)"
            ) from None
        return (
            f"vllm_server ({elsewhere}: CUDA and vLLM not checked here), server {t.vllm_server_url} answers"
        )
    try:
        require_vllm(cfg)
    except ConfigError as exc:
        if torch.cuda.is_available():
            raise
        raise ConfigError(
            f"{exc} (to plan it for a GPU machine from here: --dry-run --gpu-memory GB)"
        ) from None
    row = f"{t.generation} (vLLM installed)"
    return row + (f", server {t.vllm_server_url} answers" if t.generation == "vllm_server" else "")
