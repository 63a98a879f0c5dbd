"""The in-process simulator server warns, at start, when its OpenMP threads would spin-wait: with
``OMP_WAIT_POLICY`` unset a served call ran 6.8x the in-process time beside other busy processes
(docs/simulator.md, "Served vs in-process"), and only the environment at start-up can change it."""

from __future__ import annotations

import logging

import pytest
import torch

import simulators.openai_server as server


@pytest.mark.parametrize(
    ("policy", "threads", "warns"),
    [(None, 2, True), (None, 1, False), ("PASSIVE", 2, False), ("ACTIVE", 4, False)],
)
def test_the_server_warns_when_its_openmp_threads_would_spin(
    monkeypatch, caplog, tiny_model_dir, policy, threads, warns
):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    started = []
    monkeypatch.setattr(server.uvicorn, "run", lambda app, **options: started.append(options))
    with caplog.at_level(logging.WARNING, logger=server.__name__):
        server.serve_openai(str(tiny_model_dir), port=9003)
    (options,) = started
    assert (options["host"], options["port"], options["log_level"]) == ("127.0.0.1", 9003, "info")
    assert options["timeout_keep_alive"] == 5.0  # idle and half-sent connections are closed
    warnings = [r.getMessage() for r in caplog.records if r.name == server.__name__]
    if not warns:
        assert warnings == []
        return
    (message,) = warnings
    assert f"OMP_WAIT_POLICY is unset: this server's {threads} OpenMP threads spin-wait" in message
    assert "start it as OMP_WAIT_POLICY=PASSIVE zerosim simulator serve" in message and "\n" not in message


@pytest.mark.parametrize(("given", "served_with"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_zerosim_simulator_serve_starts_its_threads_passive_unless_told(
    monkeypatch, zerosim_cli, given, served_with
):
    """The command sets the policy before torch loads (a user's own value is kept), so its server does not spin."""
    if given is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", given)
    seen = []

    def start(*args, **kwargs):
        import os

        seen.append(os.environ.get("OMP_WAIT_POLICY"))
        return 0

    monkeypatch.setattr(server, "start_simulator_server", start)
    zerosim_cli("simulator", "serve", "--threads", "1")
    assert seen == [served_with]
