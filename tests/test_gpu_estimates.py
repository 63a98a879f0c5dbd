"""Estimates of an experiment that runs on GPUs: the GPU rate table, marked unmeasured until a stage of the
experiment itself is timed; the CPU presets' estimates as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerosim.experiment import build_stages, load_experiment
from zerosim.experiment.estimates import GPU_RATES, estimate_notes, estimates, on_gpu, rates_basis
from zerosim.experiment.kinds import KINDS, Kind

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "configs" / "experiments"
GPU_PRESET = PRESETS / "zerosearch-qwen2.5-3b.yaml"
CPU_PRESETS = ["sim-vs-real-cpu.yaml", "sim-vs-real-smoke.yaml", "curriculum-ablation-cpu.yaml"]


def stages_of(preset: Path, tmp_path: Path, *overrides: str):
    cfg = load_experiment(preset, [f"output_dir={tmp_path}", *overrides])
    root = tmp_path / cfg.name
    return build_stages(cfg, root), root


def test_the_gpu_preset_is_estimated_with_gpu_rates_that_say_they_are_unmeasured(tmp_path):
    stages, root = stages_of(GPU_PRESET, tmp_path)
    assert on_gpu(stages)
    est, notes = estimates(stages, root), estimate_notes(stages, root)
    timed = [s for s in stages if s.kind != Kind.report]
    assert {s.kind for s in timed} >= {Kind.train, Kind.eval}
    for stage in timed:
        assert est[stage.name] == pytest.approx(
            KINDS[stage.kind].estimate(stage, GPU_RATES[stage.kind].seconds)
        )
        assert est[stage.name] < stage.estimate_s  # the CPU rates would have said days
        assert notes[stage.name] == "GPU rates, unmeasured", stage.name
    assert not any(rate.measured for rate in GPU_RATES.values())  # no GPU has timed a stage yet
    assert "unmeasured" in rates_basis(stages)


def test_the_gpu_preset_evaluates_with_vllm(tmp_path):
    stages, _ = stages_of(GPU_PRESET, tmp_path)
    evals = [s for s in stages if s.kind == Kind.eval]
    assert len(evals) > 10 and all(s.config.generation == "vllm" for s in evals)


@pytest.mark.parametrize("preset", CPU_PRESETS)
def test_the_cpu_presets_estimates_are_unchanged(preset, tmp_path):
    stages, root = stages_of(PRESETS / preset, tmp_path)
    assert not on_gpu(stages)
    assert estimates(stages, root) == {s.name: s.estimate_s for s in stages}  # the shipped CPU rates
    assert set(estimate_notes(stages, root).values()) == {""}
    assert rates_basis(stages) == "2 CPU cores, embedded models"
    assert all(s.config.generation == "hf" for s in stages if s.kind == Kind.eval)


def test_a_gpu_stage_timed_here_replaces_the_guess(tmp_path):
    stages, root = stages_of(GPU_PRESET, tmp_path, "seeds=[0]")
    first = next(s for s in stages if s.kind == Kind.eval)
    units = KINDS[Kind.eval].units(first.config)
    first.dir(root).mkdir(parents=True)
    record = {"key": first.key, "outputs": {}, "seconds": 15.0 + 0.05 * units, "others_cpu": 0.01}
    (first.dir(root) / "stage.json").write_text(json.dumps(record))
    est, notes = estimates(stages, root), estimate_notes(stages, root)
    for stage in (s for s in stages if s.kind == Kind.eval):
        assert est[stage.name] == pytest.approx(KINDS[Kind.eval].estimate(stage, 0.05))
        assert notes[stage.name] == "measured here"
    train = next(s for s in stages if s.kind == Kind.train)
    assert notes[train.name] == "GPU rates, unmeasured"
