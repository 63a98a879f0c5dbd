"""Which weights a result came from (zerosim/experiment/provenance.py): every stage that writes a model records
its digest and the machine, every stage the digests of the models it read; a model re-run with other weights
sends its readers to run again, the same weights do not; the report says which instance each seed read; an
export with its models travels and is checked on import. On tiny models: each experiment runs in seconds."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from zerosim.experiment.provenance import SHORT


@pytest.fixture
def small(tiny_experiment, tiny_model_dir):
    """The smoke preset cut to a warm start, one trained arm (real) and the untrained one (none): no simulator
    stages (a ready simulator), no baselines. Returns (config path, tmp folder, overrides)."""
    config, tmp = tiny_experiment
    few = [
        "arms.sim.enabled=false",
        "arms.sim-nocurriculum.enabled=false",
        "arms.mixed.enabled=false",
        f"simulator.model={tiny_model_dir}",
        "eval.baselines=[]",
    ]
    return config, tmp, few


def _records(root: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (root / "stages").glob("*/stage.json")}


def _other_weights(monkeypatch):
    """The warm start's job, its weights nudged after saving: a re-run on another machine kind (bf16 updates on
    AMX, fp32 elsewhere) under the same key."""
    from safetensors.torch import load_file, save_file

    from zerosim.experiment.kinds import KINDS, Kind

    job = KINDS[Kind.warmstart]

    def run(stage, ctx):
        out = job.run(stage, ctx)
        path = Path(out["path"]) / "model.safetensors"
        tensors = load_file(path)
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] + 1e-3
        save_file(tensors, path, metadata={"format": "pt"})
        return out

    monkeypatch.setitem(KINDS, Kind.warmstart, replace(job, run=run))


def test_a_tiny_warm_start_run_twice_on_one_machine_gives_the_same_weights(small):
    """Determinism measured, not assumed: the same warm start (same key, same seed) run twice on this machine
    writes byte-identical weights, and each record holds that digest and the machine it ran on."""
    from zerosim.experiment import load_experiment, run_experiment
    from zerosim.experiment.provenance import file_sha256, machine_kind

    config, tmp, few = small
    digests, files = [], []
    for where in ("first", "second"):
        cfg = load_experiment(config, [*few, f"output_dir={tmp / where}"])
        result = run_experiment(cfg, echo=lambda line: None, stop_after="warmstart")
        assert result.ran == ["warmstart"]
        record = _records(result.root)["warmstart"]
        weights = Path(record["outputs"]["path"].replace("<root>", str(result.root))) / "model.safetensors"
        assert record["model"]["files"]["model.safetensors"] == file_sha256(weights)
        assert record["machine"] == machine_kind() and record["reads"] == {}
        digests.append(record["model"]["sha256"])
        files.append(hashlib.sha256(weights.read_bytes()).hexdigest())
    print(f"warm start twice on {machine_kind()}: sha256 {digests[0][:12]} / {digests[1][:12]}")
    assert files[0] == files[1] and digests[0] == digests[1], "one machine, one seed: other weights"


def test_a_re_run_model_with_other_weights_re_runs_its_readers_the_same_weights_do_not(small, monkeypatch):
    from zerosim.experiment import build_stages, load_experiment, plan_rows, run_experiment
    from zerosim.experiment.run import plan_statuses

    config, tmp, few = small
    cfg = load_experiment(config, few)
    first = run_experiment(cfg, echo=lambda line: None)
    root = first.root
    before = _records(root)
    warm = before["warmstart"]["model"]["sha256"]
    trained = before["train-real-s0"]["model"]["sha256"]
    assert len(warm) == 64 and before["warmstart"]["machine"]
    assert before["train-real-s0"]["reads"] == {"warmstart": warm}
    assert before["eval-real-s0-bm25"]["reads"] == {"train-real-s0": trained}
    assert before["eval-none-s0-bm25"]["reads"] == {"warmstart": warm}
    assert "model" not in before["eval-real-s0-bm25"] and before["report"]["reads"] == {}

    # the report: which instance each seed's row read, and every stage's digests in the manifest
    report = json.loads((root / "report.json").read_text())
    (real,) = [r for r in report["rows"] if r["arm"] == "real"]
    assert real["provenance"] == {
        "0": {"train-real-s0": f"{trained[:SHORT]}…", "warmstart": f"{warm[:SHORT]}…"}
    }
    (none,) = [r for r in report["rows"] if r["arm"] == "none"]
    assert none["provenance"] == {"0": {"warmstart": f"{warm[:SHORT]}…"}}
    stages = report["manifest"]["stages"]
    assert stages["warmstart"]["model"] == warm and stages["train-real-s0"]["reads"] == {"warmstart": warm}
    md = (root / "report.md").read_text()
    assert f"| real | bm25 | 0 | train-real-s0 {trained[:SHORT]}…, warmstart {warm[:SHORT]}… |" in md

    # the warm start re-run with the same weights (this machine is deterministic: the test above): reused
    import shutil

    shutil.rmtree(root / "stages" / "warmstart")
    same = run_experiment(cfg, echo=lambda line: None)
    assert same.ran == ["warmstart"]
    after = _records(root)
    assert after["warmstart"]["model"]["sha256"] == warm
    assert all(after[n]["finished"] == before[n]["finished"] for n in before if n != "warmstart")

    # ... with other weights (another CPU kind, other code): what read it runs again, and the dry run says why
    shutil.rmtree(root / "stages" / "warmstart")
    stages = build_stages(cfg, root)
    plan = plan_statuses(stages, root)
    assert plan["warmstart"][0] == "run" and plan["train-real-s0"][0] == "reuse"
    assert f"once warmstart (read {warm[:SHORT]}…) has run" in plan["train-real-s0"][1]
    _other_weights(monkeypatch)
    partial = run_experiment(cfg, echo=lambda line: None, stop_after="warmstart")
    assert partial.ran == ["warmstart"]
    other = _records(root)["warmstart"]["model"]["sha256"]
    assert other != warm
    rows = {row[0]: row for row in plan_rows(cfg, stages, root)}
    reason = f"reads warmstart {warm[:SHORT]}…, now {other[:SHORT]}…"
    for name in ("train-real-s0", "eval-none-s0-bm25"):
        assert rows[name][1] == "re-run" and reason in rows[name][3], rows[name]
    lines = []
    rest = run_experiment(cfg, echo=lines.append)
    assert set(rest.ran) == {"eval-none-s0-bm25", "train-real-s0", "eval-real-s0-bm25", "report"}
    assert any("train-real-s0: re-run" in line and reason in line for line in lines), lines
    final = _records(root)
    assert final["train-real-s0"]["reads"] == {"warmstart": other}
    report = json.loads((root / "report.json").read_text())
    (real,) = [r for r in report["rows"] if r["arm"] == "real"]
    assert real["provenance"]["0"]["warmstart"] == f"{other[:SHORT]}…"


def test_a_record_from_before_digests_is_reused_and_its_instance_said_unrecorded(small, monkeypatch):
    import zerosim.core.tracking as tracking
    from zerosim.experiment import build_stages, load_experiment, run_experiment
    from zerosim.experiment.provenance import row_provenance
    from zerosim.experiment.run import plan_statuses

    # run from a checkout with uncommitted changes: each record names the diff's digest, the diff beside it
    diff = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    dirty = {
        "version": "0",
        "commit": "c" * 40,
        "dirty": True,
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest(),
    }
    monkeypatch.setattr(tracking, "code_version", lambda root=None: dirty)
    monkeypatch.setattr(tracking, "code_diff", lambda root=None: diff)
    config, tmp, few = small
    cfg = load_experiment(config, few)
    root = run_experiment(cfg, echo=lambda line: None).root
    for name, record in _records(root).items():
        assert record["code"] == dirty and (root / "stages" / name / "code.diff").read_text() == diff, name
    monkeypatch.undo()
    for path in (root / "stages").glob("*/stage.json"):  # as the records of the committed ablation are
        record = json.loads(path.read_text())
        for key in ("model", "reads", "machine"):
            record.pop(key, None)
        path.write_text(json.dumps(record))
    plan = plan_statuses(build_stages(cfg, root), root)
    assert all(state == "reuse" for state, _ in plan.values()), plan
    assert plan["train-real-s0"][1] == "reads warmstart: instance unrecorded (a record from before digests)"
    assert row_provenance(_records(root))[("real", "bm25")] == {"0": "unrecorded"}
    assert run_experiment(cfg, echo=lambda line: None).ran == []


def test_an_export_with_models_travels_with_its_weights_and_is_checked_on_import(small, zerosim_cli):
    import shutil

    from zerosim.core.config import ConfigError
    from zerosim.experiment import build_stages, load_experiment, run_experiment
    from zerosim.experiment.run import plan_rows, statuses
    from zerosim.experiment.transfer import import_results

    config, tmp, few = small
    first = run_experiment(load_experiment(config, few), echo=lambda line: None)
    out = tmp / "export"
    result = zerosim_cli("experiment", "--config", config, *few, "--export", out, "--with-models")
    assert "with their models" in result.output
    assert json.loads((out / "export.json").read_text())["models"] == ["warmstart", "train-real-s0"]
    assert (out / "train-real-s0" / "real" / "final" / "model.safetensors").is_file()
    trained = _records(first.root)["train-real-s0"]["model"]["sha256"]

    # elsewhere: an evaluation still to run reads the very weights that came along, nothing is re-made
    shutil.rmtree(out / "eval-real-s0-bm25")
    there = load_experiment(config, [*few, f"output_dir={tmp / 'elsewhere'}"])
    root = tmp / "elsewhere" / there.name
    stages = build_stages(there, root)
    import_results(stages, root, out, name=there.name)
    state = statuses(stages, root)
    assert state["eval-real-s0-bm25"] == "run" and state["train-real-s0"] == state["warmstart"] == "reuse"
    second = run_experiment(there, echo=lambda line: None)
    assert second.ran == ["eval-real-s0-bm25", "report"]
    assert _records(root)["eval-real-s0-bm25"]["reads"] == {"train-real-s0": trained}

    # a model whose weights are not the ones its record names is refused, naming it; nothing is copied
    weights = out / "train-real-s0" / "real" / "final" / "model.safetensors"
    tail = weights.read_bytes()[-8:]
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    third = tmp / "third" / there.name
    with pytest.raises(ConfigError, match=r"model of train-real-s0 .*its record says"):
        import_results(build_stages(there, third), third, out, name=there.name)
    assert not (third / "stages").exists()

    # every file that changes what a model does is in its digest, not its weights alone (issue 50 item 9): a
    # generation config edited at the same size (sizes in export.json still match) is refused on import
    weights.write_bytes(weights.read_bytes()[:-8] + tail)
    generation = _edited_same_size(next((out / "warmstart").rglob("generation_config.json")))
    with pytest.raises(ConfigError, match=r"model of warmstart .*its record says"):
        import_results(build_stages(there, third), third, out, name=there.name)
    assert not (third / "stages").exists()
    generation.restore()

    # ...and a model replaced on disk after its record is refused before any stage reads it: in the dry run's
    # plan, naming the model and what changed, and in the run before the reader starts
    _edited_same_size(next((first.root / "stages" / "train-real-s0").rglob("generation_config.json")))
    stages = build_stages(load_experiment(config, few), first.root)
    with pytest.raises(
        ConfigError, match=r"train-real-s0's model .* not the one its record names .*generation_config"
    ):
        plan_rows(load_experiment(config, few), stages, first.root)
    shutil.rmtree(first.root / "stages" / "eval-real-s0-bm25")
    with pytest.raises(ConfigError, match=r"train-real-s0's model"):
        run_experiment(load_experiment(config, few), echo=lambda line: None)
    assert not (first.root / "stages" / "eval-real-s0-bm25" / "stage.json").exists()


class _edited_same_size:
    """A JSON file of a model folder with one digit changed (its size kept), and the way back."""

    def __init__(self, path: Path):
        import re

        self.path, self.text = path, path.read_text()
        self.path.write_text(re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), self.text, count=1))

    def restore(self) -> None:
        self.path.write_text(self.text)
