"""Results that travel (`zerosim experiment --export/--import`): regular files only, a manifest that is checked,
results files checked against their records on reuse, and what a surprising score needs (training curves,
samples) exported for every stage that has an MLflow run — on synthetic stage folders, no experiment run."""

import csv
import errno
import json
import os
import re
from pathlib import Path

import pytest

from zerosim.core.config import ConfigError
from zerosim.experiment import load_experiment
from zerosim.experiment.kinds import Kind, Stage

NAME = "exp"
ROOT = Path(__file__).resolve().parents[1]


def _stages() -> list[Stage]:
    return [
        Stage("warmstart", Kind.warmstart, None, [], key="k-warm"),
        Stage("eval-real-s0-bm25", Kind.eval, None, ["warmstart"], key="k-eval"),
        Stage("report", Kind.report, None, ["eval-real-s0-bm25"], key="k-report"),
    ]


def _finish(root, stage, outputs=None, **record):
    """A finished stage's folder as the run leaves it (an eval: 3 questions; its record says 3)."""
    folder = stage.dir(root)
    folder.mkdir(parents=True, exist_ok=True)
    if stage.kind == Kind.eval and outputs is None:
        (folder / "eval").mkdir(exist_ok=True)
        lines = [{"dataset": "qa", "id": f"q{i}", "em": 1.0, "f1": 1.0, "cover_em": 1.0} for i in range(3)]
        (folder / "eval" / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        outputs = {"run_id": None, "rows": [{"dataset": "qa", "n": 3}], "questions": f"<root>/stages/{stage.name}/eval/questions.jsonl"}  # fmt: skip
    if stage.kind == Kind.report and outputs is None:
        for name in ("report.json", "report.md", "report.png"):
            (root / name).write_text(name)
        outputs = {"report": "<root>/report.json", "rows": 1, "comparisons": 0}
    full = {"name": stage.name, "kind": stage.kind, "key": stage.key, "deps": stage.deps,
            "finished": "2026-01-01T00:00:00", "outputs": outputs or {}, **record}  # fmt: skip
    (folder / "stage.json").write_text(json.dumps(full))


def _experiment(root):
    stages = _stages()
    for stage in stages:
        _finish(root, stage)
    return stages


def _export(tmp_path):
    """An export of the three stages (written by today's export), and the stages."""
    from zerosim.experiment.transfer import export_results

    stages = _experiment(tmp_path / "here")
    out = tmp_path / "export"
    export_results(stages, tmp_path / "here", out, name=NAME)
    return stages, out


def _nothing_imported(root):
    assert not (root / "stages").exists() or not any((root / "stages").iterdir())


# -- regular files only -------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["file", "folder"])
def test_an_import_holding_a_link_is_refused_naming_it_and_copies_nothing(tmp_path, target):
    from zerosim.experiment.transfer import import_results

    stages, out = _export(tmp_path)
    secret = tmp_path / "secret"
    if target == "file":
        secret.write_text("password")
    else:
        secret.mkdir()
        (secret / "key").write_text("password")
    link = out / "eval-real-s0-bm25" / "eval" / "notes"
    link.symlink_to(secret)
    root = tmp_path / "there"
    with pytest.raises(ConfigError, match=re.escape(str(link))) as refused:
        import_results(stages, root, out, name=NAME)
    assert "link" in str(refused.value)
    _nothing_imported(root)


def test_an_import_holding_a_pipe_or_a_linked_stage_folder_is_refused(tmp_path):
    from zerosim.experiment.transfer import import_results

    stages, out = _export(tmp_path)
    pipe = out / "warmstart" / "pipe"
    os.mkfifo(pipe)
    root = tmp_path / "there"
    with pytest.raises(ConfigError, match=re.escape(str(pipe))):
        import_results(stages, root, out, name=NAME)
    _nothing_imported(root)
    pipe.unlink()
    elsewhere = tmp_path / "elsewhere"
    (out / "warmstart").rename(elsewhere)
    (out / "warmstart").symlink_to(elsewhere)  # the stage's folder itself a link
    with pytest.raises(ConfigError, match="link"):
        import_results(stages, root, out, name=NAME)
    _nothing_imported(root)


def test_an_export_copies_no_link(tmp_path):
    from zerosim.experiment.transfer import export_results

    root = tmp_path / "here"
    stages = _experiment(root)
    (tmp_path / "secret").write_text("password")
    link = stages[1].dir(root) / "eval" / "notes.txt"
    link.symlink_to(tmp_path / "secret")
    out = tmp_path / "export"
    with pytest.raises(ConfigError, match=re.escape(str(link))):
        export_results(stages, root, out, name=NAME)
    assert not out.exists() or not any(out.iterdir())  # checked first: nothing written


def test_an_import_is_bounded_by_what_its_manifest_lists(tmp_path):
    from zerosim.experiment.transfer import import_results

    stages, out = _export(tmp_path)
    listed = json.loads((out / "export.json").read_text())["files"]
    assert listed["eval-real-s0-bm25"]["eval/questions.jsonl"] > 0
    extra = out / "warmstart" / "big.bin"
    extra.write_bytes(b"0" * 1000)
    root = tmp_path / "there"
    with pytest.raises(ConfigError, match=re.escape(str(extra)) + ".*not listed"):
        import_results(stages, root, out, name=NAME)
    extra.unlink()
    grown = out / "eval-real-s0-bm25" / "eval" / "questions.jsonl"
    grown.write_text(grown.read_text() * 2)
    with pytest.raises(ConfigError, match=re.escape(str(grown)) + ".*bytes"):
        import_results(stages, root, out, name=NAME)
    _nothing_imported(root)


def test_an_export_into_the_experiments_own_folder_is_refused(tmp_path):
    from zerosim.experiment.transfer import export_results

    root = tmp_path / "here"
    stages = _experiment(root)
    model = stages[0].dir(root) / "warmstart" / "final" / "model.safetensors"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"weights")
    for inside in (root / "stages", root, stages[0].dir(root) / "x"):
        with pytest.raises(ConfigError, match="inside the experiment"):
            export_results(stages, root, inside, name=NAME)
    assert model.read_bytes() == b"weights"


# -- the manifest ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "what"),
    [
        ("{not json", "not JSON"),
        ('["a", "list"]', "not a mapping"),
        ('{"experiment": "exp", "stages": "warmstart"}', "stages"),
        ('{"experiment": "exp", "stages": [1, 2]}', "stages"),
        ('{"stages": []}', "experiment"),
        ('{"experiment": "exp", "stages": [], "files": []}', "files"),
        ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ],
    ids=[
        "bad-json",
        "a-list",
        "stages-a-string",
        "stages-not-names",
        "no-experiment",
        "files-a-list",
        "nested-100000-deep",
    ],
)
def test_a_malformed_manifest_is_refused_naming_the_file(tmp_path, content, what):
    from zerosim.experiment.transfer import import_results

    (tmp_path / "export").mkdir()
    manifest = tmp_path / "export" / "export.json"
    manifest.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(str(manifest))) as refused:
        import_results(_stages(), tmp_path / "there", tmp_path / "export", name=NAME)
    assert what in str(refused.value) and "\n" not in str(refused.value)


def test_a_manifest_over_the_size_bound_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    import zerosim.experiment.transfer as transfer

    (tmp_path / "export").mkdir()
    manifest = tmp_path / "export" / "export.json"
    manifest.write_text(json.dumps({"experiment": NAME, "stages": [], "padding": "x" * 200}))
    monkeypatch.setattr(transfer, "MAX_JSON_BYTES", 100)
    with pytest.raises(ConfigError, match=re.escape(str(manifest))) as refused:
        transfer.import_results(_stages(), tmp_path / "there", tmp_path / "export", name=NAME)
    assert "bytes" in str(refused.value) and "\n" not in str(refused.value)


def test_a_stage_record_nested_too_deep_is_refused_naming_it(tmp_path):
    from zerosim.experiment.transfer import import_results

    stages, out = _export(tmp_path)
    record = out / "warmstart" / "stage.json"
    record.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=re.escape(str(record))) as refused:
        import_results(stages, tmp_path / "there", out, name=NAME)
    assert "nested too deep" in str(refused.value) and "\n" not in str(refused.value)
    _nothing_imported(tmp_path / "there")


# -- a dry run writes nothing ----------------------------------------------------------------------------------
def test_a_dry_run_import_writes_nothing_and_plans_as_if_imported(tmp_path):
    from zerosim.experiment.run import statuses
    from zerosim.experiment.transfer import plan_import, preview

    stages, out = _export(tmp_path)
    root = tmp_path / "there"
    coming = plan_import(stages, root, out, name=NAME)
    assert [s.name for s in coming] == ["warmstart", "eval-real-s0-bm25", "report"]
    with preview(stages, root, {s.name: out / s.name for s in coming}) as seen:
        state = statuses(stages, seen)
    assert state["warmstart"] == state["eval-real-s0-bm25"] == "reuse"
    assert state["report"] == "reuse"  # its tables travel in the export and come back with it
    assert not root.exists()


def test_another_experiments_results_bring_only_the_stages_that_did_this_ones_work(tmp_path):
    """A re-run under a new name (an ablation v2) imports its predecessor's stages whose name and key match
    (a shared warm start) and nothing that only shares a name."""
    from zerosim.experiment.transfer import import_results, plan_import

    stages, out = _export(tmp_path)
    ours = [
        stages[0],  # the same warm start
        Stage("eval-real-s0-bm25", Kind.eval, None, ["warmstart"], key="k-eval-v2"),  # other settings
        Stage("report", Kind.report, None, ["eval-real-s0-bm25"], key="k-report-v2"),
    ]
    root = tmp_path / "v2"
    assert [s.name for s in plan_import(ours, root, out, name="exp-v2")] == ["warmstart"]
    assert import_results(ours, root, out, name="exp-v2") == ["warmstart"]
    assert (root / "stages" / "warmstart" / "stage.json").is_file()
    assert not (root / "stages" / "eval-real-s0-bm25").exists()


def test_a_dry_run_import_from_the_cli_writes_nothing(tmp_path, zerosim_cli, monkeypatch):
    smoke = ROOT / "configs" / "experiments" / "sim-vs-real-smoke.yaml"
    monkeypatch.chdir(ROOT)
    (tmp_path / "export").mkdir()
    name = load_experiment(smoke).name
    (tmp_path / "export" / "export.json").write_text(json.dumps({"experiment": name, "stages": []}))
    result = zerosim_cli(
        "experiment", "--config", smoke, "--dry-run", "--import", tmp_path / "export",
        f"output_dir={tmp_path / 'out'}", f"tracking.tracking_uri=sqlite:///{tmp_path / 'm.db'}", code=None,
    )  # fmt: skip
    assert "would import 0 stages" in result.output, result.output
    assert not (tmp_path / "out").exists()


# -- results files checked against their records on reuse --------------------------------------------------------
def test_a_reused_report_must_have_its_files(tmp_path):
    from zerosim.experiment.run import plan_statuses

    stages = _experiment(tmp_path)
    assert plan_statuses(stages, tmp_path)["report"] == ("reuse", "")
    (tmp_path / "report.png").unlink()
    state, why = plan_statuses(stages, tmp_path)["report"]
    assert state == "re-run" and "report.png" in why


def test_a_truncated_results_file_is_refused_on_reuse_counted_by_an_old_record(tmp_path):
    from zerosim.experiment.run import plan_statuses

    stages = _experiment(tmp_path)  # records from before file digests: checked by count
    questions = stages[1].dir(tmp_path) / "eval" / "questions.jsonl"
    questions.write_text("".join(questions.read_text().splitlines(keepends=True)[:2]))
    with pytest.raises(ConfigError, match=re.escape(str(questions))) as refused:
        plan_statuses(stages, tmp_path)
    assert "2 lines" in str(refused.value) and "3" in str(refused.value)


def test_a_hand_edited_results_file_is_refused_by_its_digest(tmp_path):
    from zerosim.experiment.run import plan_statuses
    from zerosim.experiment.stagefiles import written_files

    stages = _experiment(tmp_path)
    eval_stage = stages[1]
    files = written_files(eval_stage, tmp_path)
    assert set(files) == {"eval/questions.jsonl"} and len(files["eval/questions.jsonl"]) == 64
    record = json.loads((eval_stage.dir(tmp_path) / "stage.json").read_text())
    (eval_stage.dir(tmp_path) / "stage.json").write_text(json.dumps({**record, "files": files}))
    assert plan_statuses(stages, tmp_path)["eval-real-s0-bm25"][0] == "reuse"
    questions = eval_stage.dir(tmp_path) / "eval" / "questions.jsonl"
    questions.write_text(questions.read_text().replace('"em": 1.0', '"em": 0.0', 1))  # same count
    with pytest.raises(ConfigError, match=re.escape(str(questions)) + ".*sha256"):
        plan_statuses(stages, tmp_path)


def test_an_import_of_an_edited_results_file_is_refused(tmp_path):
    from zerosim.experiment.transfer import import_results

    stages, out = _export(tmp_path)
    questions = out / "eval-real-s0-bm25" / "eval" / "questions.jsonl"
    questions.write_text(questions.read_text().splitlines(keepends=True)[0])
    manifest = json.loads((out / "export.json").read_text())
    manifest["files"]["eval-real-s0-bm25"]["eval/questions.jsonl"] = questions.stat().st_size
    (out / "export.json").write_text(json.dumps(manifest))  # the manifest edited to match
    root = tmp_path / "there"
    with pytest.raises(ConfigError, match=re.escape(str(questions))):
        import_results(stages, root, out, name=NAME)
    _nothing_imported(root)


# -- what a surprising score needs travels ---------------------------------------------------------------------
def _logged_run(tracking_uri, parent=None):
    """An MLflow run with two metrics over 3 steps and a samples/ artifact; its id."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.create_experiment(f"e{len(client.search_experiments())}")
    tags = {"mlflow.parentRunId": parent} if parent else {}
    run = client.create_run(experiment, tags=tags)
    for step in range(3):
        client.log_metric(run.info.run_id, "rollout/reward", 0.1 * step, step=step)
        client.log_metric(run.info.run_id, "losses/loss", 1.0 - step, step=step)
    client.log_text(run.info.run_id, '{"answer": "Paris"}\n', "samples/trajectories.jsonl")
    client.set_terminated(run.info.run_id, status="FAILED")
    return run.info.run_id


def test_every_stage_with_a_run_exports_its_curves_and_samples_failed_ones_too(tmp_path, mlflow_db):
    from zerosim.experiment.transfer import export_results

    root = tmp_path / "here"
    stages = _experiment(root)
    warm = _logged_run(mlflow_db)
    record = json.loads((stages[0].dir(root) / "stage.json").read_text())
    (stages[0].dir(root) / "stage.json").write_text(json.dumps({**record, "runs": [warm]}))
    failed = Stage("train-real-s0", Kind.train, None, ["warmstart"], key="k-train")
    crashed = _logged_run(mlflow_db)  # a training stage that failed: no record, its run id in attempt.json
    failed.dir(root).mkdir(parents=True)
    (failed.dir(root) / "attempt.json").write_text(
        json.dumps({"seconds": 3.0, "attempts": 1, "runs": [crashed]})
    )
    out = tmp_path / "export"
    written = export_results([*stages, failed], root, out, name=NAME, tracking_uri=mlflow_db)
    assert "train-real-s0" not in written  # not a finished stage: nothing to reuse
    for stage, run_id in (("warmstart", warm), ("train-real-s0", crashed)):
        with (out / stage / "mlflow" / "metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0])[:3] == ["step", "metric", "value"]
        values = {(r["metric"], int(r["step"])): float(r["value"]) for r in rows}
        assert values[("rollout/reward", 2)] == pytest.approx(0.2) and values[("losses/loss", 0)] == 1.0
        assert len(rows) == 6 and {r["run_id"] for r in rows} == {run_id}
        assert (out / stage / "mlflow" / "samples" / "trajectories.jsonl").read_text().startswith('{"answer"')
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["unfinished"] == ["train-real-s0"] and "train-real-s0" not in manifest["stages"]


def test_a_stage_records_the_runs_it_started_killed_attempts_too(tmp_path, mlflow_db):
    import mlflow

    from zerosim.experiment.run import StageClock
    from zerosim.experiment.runlogs import runs_started, stage_runs

    client = mlflow.MlflowClient(mlflow_db)
    parent = client.create_run(client.create_experiment("p")).info.run_id
    since = client.get_run(parent).info.start_time
    child = _logged_run(mlflow_db, parent=parent)
    assert runs_started(parent, since, tracking_uri=mlflow_db) == [child]
    folder = tmp_path / "stage"
    with StageClock(folder, continuing=False) as clock:
        clock.runs = [child]
    with StageClock(folder, continuing=True) as clock:  # a continued attempt keeps the first one's runs
        assert clock.runs == [child]
    assert stage_runs(folder, None) == [child]
    (folder / "real").mkdir()
    (folder / "real" / "mlflow_run.json").write_text(json.dumps({"run_id": "r-train"}))  # a training job's
    assert stage_runs(folder, {"outputs": {"run_id": "r-out"}}) == ["r-out", child, "r-train"]


def test_train_dry_run_refuses_fewer_than_one_process(zerosim_cli):
    for n in ("0", "-1"):
        result = zerosim_cli("train", "--dry-run", "--processes", n, code=2)
        assert "--processes" in result.output


def test_a_training_stages_best_policy_does_not_travel_without_models_and_old_records_still_import(tmp_path):
    """The best validated policy (``best/``, beside ``final/``) is a model folder: its tokenizer and config do
    not travel in a results export. A record from before that rule lists them among its files: still reused
    here, and its export imported."""
    from zerosim.experiment.provenance import MODEL_DIRS
    from zerosim.experiment.transfer import export_results, import_results
    from zerosim.training.guard import BEST_DIR

    assert BEST_DIR in MODEL_DIRS
    root = tmp_path / "here"
    train = Stage("train-real-s0", Kind.train, None, [], key="k-train")
    best = train.dir(root) / "real" / "best"
    best.mkdir(parents=True)
    (best / "tokenizer.json").write_text("{}")
    (train.dir(root) / "real" / "result.json").write_text("{}")
    files = {"real/best/tokenizer.json": None, "real/result.json": None}  # listed as an older record did
    _finish(root, train, {"path": str(best.parent / "final")}, files=files)
    out = tmp_path / "export"
    export_results([train], root, out, name=NAME)
    assert (out / "train-real-s0" / "real" / "result.json").is_file()
    assert not (out / "train-real-s0" / "real" / "best").exists()
    assert import_results([train], tmp_path / "there", out, name=NAME) == ["train-real-s0"]


def test_a_critic_and_a_killed_checkpoint_deletion_do_not_travel(tmp_path):
    """A PPO run's ``critic/`` is a model folder, and ``.deleting-checkpoint-N/`` (a deletion killed midway) is
    hidden: neither is among a training stage's results files, so neither is exported as a stub."""
    from zerosim.experiment.stagefiles import written_files

    root = tmp_path / "here"
    train = Stage("train-real-s0", Kind.train, None, [], key="k-train")
    run = train.dir(root) / "real"
    for folder in ("critic", ".deleting-checkpoint-2"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "result.json").write_text("{}")
    assert set(written_files(train, root)) == {"real/result.json"}


def test_a_record_naming_files_outside_its_stage_folder_is_refused_on_import_and_on_reuse(
    tmp_path, zerosim_cli, monkeypatch
):
    """An exported eval record whose outputs.questions points at another file (every answer right) must not
    reach the report; a record whose model path is elsewhere must not be reused."""
    import shutil

    REPO = ROOT
    monkeypatch.chdir(REPO)
    export = tmp_path / "export"
    shutil.copytree(REPO / "results" / "curriculum-ablation-v2-cpu", export)
    record_file = export / "eval-real-s0-bm25" / "stage.json"
    record = json.loads(record_file.read_text())
    forged = tmp_path / "all-right.jsonl"
    forged.write_text("")
    record["outputs"]["questions"] = str(forged)
    record_file.write_text(json.dumps(record))
    manifest = json.loads(
        (export / "export.json").read_text()
    )  # the sizes updated, as a careful editor would
    manifest["files"]["eval-real-s0-bm25"]["stage.json"] = record_file.stat().st_size
    (export / "export.json").write_text(json.dumps(manifest))
    refused = zerosim_cli(
        "experiment", "--config", "configs/experiments/curriculum-ablation-v2-cpu.yaml", "--import", str(export),
        f"output_dir={tmp_path / 'runs'}", "--dry-run", code=None,
    )  # fmt: skip
    assert refused.exit_code == 2
    assert "eval-real-s0-bm25/stage.json: outputs.questions is" in refused.output
    assert "not inside the stage's folder" in refused.output


def test_a_local_record_pointing_elsewhere_is_refused_when_read(tmp_path):
    from zerosim.core.config import ConfigError
    from zerosim.experiment.kinds import Kind, Stage, read_stage

    stage = Stage("train-real-s0", Kind.train, None, [])
    folder = stage.dir(tmp_path)
    folder.mkdir(parents=True)
    (folder / "stage.json").write_text(json.dumps({"key": "k", "outputs": {"path": "/tmp/other/final"}}))
    with pytest.raises(
        ConfigError, match=r"outputs.path is '/tmp/other/final', not inside the stage's folder"
    ):
        read_stage(stage, tmp_path)
    (folder / "stage.json").write_text(
        json.dumps({"key": "k", "outputs": {"path": "<root>/stages/train-real-s0/real/final"}})
    )
    assert read_stage(stage, tmp_path)["outputs"]["path"] == str(tmp_path / "stages/train-real-s0/real/final")


def test_an_export_dry_run_writes_nothing_and_an_import_beside_an_export_comes_first(
    tmp_path, zerosim_cli, monkeypatch
):
    monkeypatch.chdir(ROOT)
    config = "configs/experiments/curriculum-ablation-cpu.yaml"
    common = ["experiment", "--config", config, f"output_dir={tmp_path / 'runs'}"]
    dry = zerosim_cli(*common, "--import", "results/curriculum-ablation-cpu", "--export", str(tmp_path / "e1"),
                      "--dry-run").output  # fmt: skip
    assert "would export 0 finished stages" in dry and "would import" in dry
    assert not (tmp_path / "e1").exists() and not (tmp_path / "runs").exists()
    out = zerosim_cli(
        *common, "--import", "results/curriculum-ablation-cpu", "--export", str(tmp_path / "e2")
    ).output
    brought = int(re.search(r"imported (\d+) stages", out).group(1))
    assert brought > 0 and f"exported {brought} finished stages" in out.replace("\n", " ")
    exported = json.loads((tmp_path / "e2" / "export.json").read_text())
    assert len(exported["stages"]) == brought


def test_the_report_travels_with_its_record(tmp_path):
    """report.json, report.md and the plot (written into the experiment's folder) are in the export, listed."""
    _, out = _export(tmp_path)
    assert sorted(p.name for p in (out / "report").iterdir()) == [
        "report.json",
        "report.md",
        "report.png",
        "stage.json",
    ]
    listed = json.loads((out / "export.json").read_text())["files"]["report"]
    assert set(listed) == {"report.json", "report.md", "report.png", "stage.json"}


@pytest.mark.parametrize(
    ("way", "fault", "words"),
    [
        ("export", errno.ENOSPC, "the disk holding"),
        ("export", errno.EFBIG, "met a file-size limit (EFBIG"),
        ("import", errno.EROFS, "is on a read-only file system (EROFS"),
        ("import", errno.ENOSPC, "the disk holding"),
    ],
)
def test_a_write_fault_during_an_export_or_import_is_one_line_and_leaves_no_temporary_folder(
    tmp_path, monkeypatch, way, fault, words
):
    """A full disk, a read-only folder or a file-size limit met while copying: one line naming where, the
    errno's meaning and the way out — not an OSError traceback — and no `.<stage>.tmp` / `.import` left."""
    import zerosim.experiment.transfer as transfer
    from zerosim.core.fsutil import WriteFaultError

    stages, out = (
        _export(tmp_path) if way == "import" else (_experiment(tmp_path / "here"), tmp_path / "export")
    )
    copy, calls = transfer._copy_regular, []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the second file of the first stage: half a stage written
            raise OSError(fault, os.strerror(fault), str(dst))
        return copy(src, dst)

    monkeypatch.setattr(transfer, "_copy_regular", failing)
    there = tmp_path / "there"
    with pytest.raises(WriteFaultError) as raised:
        if way == "export":
            transfer.export_results(stages, tmp_path / "here", out, name=NAME)
        else:
            transfer.import_results(stages, there, out, name=NAME)
    message = str(raised.value)
    assert "\n" not in message and words in message and f"--{way} " in message, message
    assert f"then {way} again" in message
    written = out if way == "export" else there / "stages"
    assert not [p.name for p in written.rglob("*") if p.name.endswith((".tmp", ".import"))]
    assert (
        not (out / "export.json").exists() or way == "import"
    )  # an export without its manifest is no export


def test_an_imported_report_brings_its_tables_and_is_reused_and_a_dry_run_plans_it_so(tmp_path):
    """The report's files travel in its export folder; an import puts them back where the report stage wrote
    them (the experiment's folder), so the report is reused, not written again — and the dry run's preview
    plans the same. An edited report.md in an export is refused by its record's digest."""
    from zerosim.experiment.run import plan_statuses
    from zerosim.experiment.stagefiles import written_files
    from zerosim.experiment.transfer import export_results, import_results, preview

    here, out = tmp_path / "here", tmp_path / "export"
    stages = _experiment(here)
    _finish(
        here, stages[2], files=written_files(stages[2], here)
    )  # the report's digests, as a run records them
    export_results(stages, here, out, name=NAME)
    with preview(stages, tmp_path / "there", {s.name: out / s.name for s in stages}) as view:
        assert plan_statuses(stages, view)["report"] == ("reuse", "")
    there = tmp_path / "there"
    import_results(stages, there, out, name=NAME)
    assert (there / "report.json").read_text() == "report.json" and not (
        there / "stages" / "report" / "report.md"
    ).exists()
    assert plan_statuses(stages, there)["report"] == ("reuse", "")

    (out / "report" / "report.md").write_text("report.mX")  # the same size: caught by its digest
    with pytest.raises(ConfigError, match=r"report: .*report.md has sha256 .*edited or cut short"):
        import_results(stages, tmp_path / "third", out, name=NAME)
