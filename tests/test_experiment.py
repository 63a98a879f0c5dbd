"""`zerosim experiment`: the smoke preset end to end on tiny models (every stage, the report, reuse, a kill,
a changed arm), and the bootstrap on cases whose answer is known."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "sim-vs-real-smoke.yaml"


def test_bootstrap_interval_of_a_known_mean():
    from zerosim.experiment.stats import bootstrap_mean

    x = np.array([1.0] * 200 + [0.0] * 200)  # mean 0.5, standard error 0.025
    mean, low, high = bootstrap_mean(x, confidence=0.95, resamples=4000, seed=0)
    assert mean == 0.5
    assert low == pytest.approx(0.5 - 1.96 * 0.025, abs=0.008)
    assert high == pytest.approx(0.5 + 1.96 * 0.025, abs=0.008)


def test_paired_bootstrap_sees_what_an_unpaired_one_cannot():
    """Two policies answer the same 400 questions; b is right on 200, a on the same 200 less 20: a's EM is 90%
    of b's, and pairing makes that interval tight (unpaired, the two means' intervals overlap)."""
    from zerosim.experiment.stats import bootstrap_mean, compare

    b = np.array([1.0] * 200 + [0.0] * 200)
    a = b.copy()
    a[:20] = 0.0
    stats = compare(a, b, confidence=0.95, resamples=4000, seed=0)
    assert stats["levels"] == "questions" and stats["ratio_reliable"]
    assert stats["ratio"] == pytest.approx(0.9)
    assert stats["diff"] == pytest.approx(-0.05)
    assert stats["ratio_low"] < 0.9 < stats["ratio_high"]
    assert stats["ratio_high"] < 0.95  # a is worse, and the paired interval says so
    assert stats["diff_high"] < 0
    _, a_low, a_high = bootstrap_mean(a, confidence=0.95, resamples=4000, seed=0)
    _, b_low, b_high = bootstrap_mean(b, confidence=0.95, resamples=4000, seed=0)
    assert a_high > b_low  # unpaired intervals overlap
    # identical answers: ratio exactly 1 with a zero-width interval; a reference at 0 gives no ratio
    same = compare(b, b, confidence=0.95, resamples=500, seed=0)
    assert (same["ratio"], same["ratio_low"], same["ratio_high"]) == (1.0, 1.0, 1.0)
    zero = compare(a, np.zeros_like(a), confidence=0.95, resamples=500, seed=0)
    assert zero["ratio"] is None and not zero["ratio_reliable"] and zero["diff"] == pytest.approx(0.45)


def test_two_level_intervals_hold_the_seeds_variance():
    """Synthetic scores where training's variance dominates: each seed shifts every question's chance by a lot,
    questions vary little. Over 200 such experiments (3 seeds x 200 questions), the seeds-then-questions
    interval covers the true mean far more often than one that resamples questions alone, and is wider."""
    from zerosim.experiment.stats import mean_interval

    rng = np.random.default_rng(0)
    truth, covered, widths = 0.4, {"two": 0, "one": 0}, {"two": [], "one": []}
    for i in range(200):
        chance = np.clip(truth + rng.normal(0, 0.12, size=(3, 1)), 0, 1)  # a seed's shift
        scores = (rng.random((3, 200)) < chance).astype(float)
        two = mean_interval(scores, confidence=0.9, resamples=400, seed=i)
        one = mean_interval(scores.reshape(1, -1), confidence=0.9, resamples=400, seed=i)  # seeds pooled
        assert two.levels == "seeds x questions" and one.levels == "questions"
        for name, iv in (("two", two), ("one", one)):
            covered[name] += iv.low <= truth <= iv.high
            widths[name].append(iv.high - iv.low)
    assert covered["two"] > covered["one"] + 60, covered  # the question-only interval misses the truth often
    assert np.mean(widths["two"]) > 2 * np.mean(widths["one"]), (
        np.mean(widths["two"]),
        np.mean(widths["one"]),
    )
    assert covered["one"] / 200 < 0.6


def test_a_rate_of_zero_gets_an_exact_bound_and_a_ratio_guard():
    """0 of 128 is at most ~2.8% (exact binomial), not "0.0 [0.0, 0.0]"; a reference that resamples to 0 gives
    no ratio (the difference stands for it); the detectable difference narrows with more questions."""
    from zerosim.experiment.stats import compare, mean_interval

    zero = mean_interval(np.zeros(128), confidence=0.95, resamples=500, seed=0)
    assert (zero.mean, zero.low, zero.levels) == (0.0, 0.0, "exact binomial")
    assert zero.high == pytest.approx(0.0284, abs=1e-3)
    ones = mean_interval(np.ones((2, 50)), confidence=0.95, resamples=500, seed=0)
    assert ones.high == 1.0 and ones.low == pytest.approx(1 - 0.0362, abs=1e-3)

    ref = np.zeros(128)
    ref[0] = 1.0  # one right answer: many resamples hold none of it
    arm = np.zeros(128)
    arm[:10] = 1.0
    c = compare(arm, ref, confidence=0.95, resamples=2000, seed=0)
    assert c["ratio"] is None and not c["ratio_reliable"]
    assert c["diff"] == pytest.approx(9 / 128) and c["diff_low"] > 0
    small = compare(arm[:64], ref[:64] + 0.0, confidence=0.95, resamples=2000, seed=0)
    assert c["detectable"] > 0 and small["detectable"] > c["detectable"]

    # an arm at 0 on every question against a reference at ~31%: its ratio is "at most ~2%", not [0, 0]
    rng = np.random.default_rng(0)
    real = (rng.random((1, 532)) < 0.31).astype(float)
    collapsed = compare(np.zeros((1, 532)), real, confidence=0.95, resamples=2000, seed=0)
    assert collapsed["ratio"] == 0.0 and collapsed["ratio_low"] == 0.0
    assert 0.01 < collapsed["ratio_high"] < 0.05 and collapsed["ratio_reliable"]
    assert collapsed["diff_high"] > -real.mean() + 0.005 and collapsed["diff_low"] < -real.mean() - 0.02
    assert collapsed["levels"].startswith("exact binomial (arm)") and collapsed["detectable"] > 0


def _stages(root: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (root / "stages").glob("*/stage.json")}


def test_report_pairs_compare_two_arms_besides_the_reference(tmp_path, mlflow_db):
    """``report.pairs=[a:b]``: a paired comparison of two arms (a - b over seeds x questions), in its own table
    after the reference's, beside every arm's comparison with the reference."""
    import mlflow

    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.report import EvalScores, write_report
    from zerosim.job_config import EvalConfig

    rng = np.random.default_rng(0)
    rates = {"real": 0.5, "a": 0.2, "b": 0.4}
    evals, means = [], {}
    for arm, rate in rates.items():
        scores = []
        for seed in (0, 1):
            ems = (rng.random(60) < rate).astype(float)
            path = tmp_path / f"{arm}-{seed}.jsonl"
            path.write_text("".join(
                json.dumps({"dataset": "d", "id": i, "em": e, "f1": e, "cover_em": e}) + "\n"
                for i, e in enumerate(ems)
            ))  # fmt: skip
            evals.append(EvalScores(arm, "bm25", seed, path))
            scores.append(ems)
        means[arm] = float(np.mean(scores))
    cfg = ExperimentConfig()
    cfg.report.pairs = ["a:b"]
    cfg.report.resamples = 200
    mlflow.set_tracking_uri(mlflow_db)
    # an experiment of this store: the one an earlier test made active lives in another store
    experiment = mlflow.set_experiment("report-pairs")
    with mlflow.start_run(experiment_id=experiment.experiment_id):
        write_report(cfg, evals, {}, EvalConfig(), tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    pairs = [(c["arm"], c["reference"]) for c in report["comparisons"]]
    assert pairs == [("a", "real"), ("b", "real"), ("a", "b")]
    (ab,) = [c for c in report["comparisons"] if c["reference"] == "b"]
    assert ab["em"]["diff"] == pytest.approx(means["a"] - means["b"])
    assert ab["em"]["levels"] == "seeds x questions" and ab["seeds"] == ab["reference_seeds"] == 2
    assert ab["em"]["diff_low"] <= ab["em"]["diff"] <= ab["em"]["diff_high"]
    md = (tmp_path / "report.md").read_text()
    assert md.index("### Paired against `real`") < md.index("### Paired against `b`")
    assert md.count("Sentences:") == 2


def test_the_report_shows_each_training_runs_invalid_actions(tmp_path, mlflow_db):
    """Beside a trained run's scores: its trajectories with an invalid action at its first and last step and
    over training, and under the tools protocol the invalid share of all its tool calls (each step's share
    weighted by its calls), read from the MLflow store or, for a stage imported from another machine, from its
    exported metrics.csv; a step logged twice (a resumed run) counts its last value."""
    import mlflow

    from zerosim.experiment.report import _runs_markdown
    from zerosim.experiment.runlogs import TRAINING_SIGNALS, export_logs, stage_metrics, training_signals

    client = mlflow.MlflowClient(mlflow_db)
    run_id = client.create_run(client.create_experiment("training-signals")).info.run_id
    for step, (actions, share, calls) in enumerate([(0.5, 0.5, 1.0), (0.25, 0.0, 2.0), (0.0, 0.0, 1.0)], 1):
        for key, value in zip(TRAINING_SIGNALS, (actions, share, calls), strict=True):
            client.log_metric(run_id, key, value, timestamp=1000 * step, step=step)
    client.log_metric(run_id, "rollout/invalid_action_rate", 0.125, timestamp=5000, step=3)  # step 3 again
    client.log_metric(run_id, "loss", 7.0, timestamp=1000, step=1)  # not read
    want = {
        "steps": 3,
        "invalid_actions_first": 0.5,
        "invalid_actions_last": 0.125,
        "invalid_actions_mean": pytest.approx((0.5 + 0.25 + 0.125) / 3),
        "invalid_call_share": pytest.approx(0.5 / 4),  # 8 bad of the first step's 16 calls, of 64
    }
    live = tmp_path / "live"
    live.mkdir()
    history = stage_metrics(live, {"outputs": {"run_id": run_id}}, mlflow_db, TRAINING_SIGNALS)
    assert set(history) == set(TRAINING_SIGNALS)
    assert training_signals(history) == want
    imported = tmp_path / "imported"  # its run lives in another machine's store: the export's csv is read
    assert export_logs([run_id], mlflow_db, imported / "mlflow") == 1
    elsewhere = {"outputs": {"run_id": "f" * 32}}
    assert training_signals(stage_metrics(imported, elsewhere, mlflow_db, TRAINING_SIGNALS)) == want
    tags = {"rollout/invalid_action_rate": {1: 0.5, 2: 0.0}}  # no tool metrics under the tags protocol
    assert training_signals(tags)["invalid_call_share"] is None and training_signals({}) is None

    signals = training_signals(history)
    rows = [
        {
            "arm": "tools",
            "engine": "bm25",
            "dataset": "d",
            "runs": [{"seed": 0, "em": 0.4, "training": signals}],
        },
        {
            "arm": "none",
            "engine": "bm25",
            "dataset": "d",
            "runs": [{"seed": None, "em": 0.1, "training": None}],
        },
    ]
    lines = _runs_markdown(rows)
    assert "invalid tool calls" in lines[3] and lines[4].count("---") == 9
    assert lines[5].endswith("| 50.0% → 12.5% (29.2%) | 12.5% |") and lines[6].endswith("| - | - |")
    untrained = _runs_markdown(rows[1:])  # no run trained: the table as it was
    assert "invalid" not in untrained[3] and untrained[4].count("---") == 7


def test_smoke_experiment_end_to_end(tiny_experiment, zerosim_cli, monkeypatch):
    import mlflow

    config, tmp = tiny_experiment
    root = tmp / "experiments" / "sim-vs-real-smoke"

    # a kill (SIGKILL, no cleanup) once the warm start has finished: the next run continues from there
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosim.cli", "experiment", "--config", str(config)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    while not (root / "stages" / "warmstart" / "stage.json").is_file():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = _stages(root)
    assert {"sim-collect", "sim-sft", "sim-dpo", "sim-quality", "warmstart"} <= set(before)
    assert "report" not in before

    monkeypatch.chdir(ROOT)
    dry = zerosim_cli("experiment", "--config", config, "--dry-run")
    status = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in dry.output.splitlines()
              if line.count("│") >= 4}  # fmt: skip
    assert all(status[name] == "reuse" for name in before), status
    assert status["report"] == "run" and "estimated" in dry.output
    if not any(name.startswith("eval-") for name in before):  # killed before any evaluation finished
        empty = zerosim_cli("experiment", "--config", config, "--interim", code=None)
        assert empty.exit_code != 0 and "no evaluation has finished" in empty.output

    zerosim_cli("experiment", "--config", config)  # in process, continuing the killed run
    stages = _stages(root)
    for name, record in before.items():
        assert stages[name]["finished"] == record["finished"], f"{name} ran again after the kill"
    arms = {"sim", "sim-nocurriculum", "real", "mixed", "none"}
    assert {f"train-{a}-s0" for a in arms - {"none"}} <= set(stages)
    assert {f"eval-{a}-s0-bm25" for a in arms} <= set(stages)
    assert {"baseline-direct-none", "baseline-rag-bm25", "report"} <= set(stages)
    # a finished training stage keeps its final policy, not the checkpoints that only served a continuation
    assert (root / "stages" / "train-real-s0" / "real" / "final" / "config.json").is_file()
    assert not list((root / "stages").glob("train-*/*/checkpoint-*"))

    report = json.loads((root / "report.json").read_text())
    assert {r["arm"] for r in report["rows"]} == arms | {"base-direct", "base-rag"}
    for row in report["rows"]:
        assert row["n"] == 4
        for k in ("em", "f1", "cover_em"):
            assert row[f"{k}_low"] <= row[k] <= row[f"{k}_high"]
    assert {c["arm"] for c in report["comparisons"]} == arms - {"real"} | {"base-rag"}
    manifest = report["manifest"]
    assert len(manifest["corpus"]["bm25"]["sha256"]) == 64
    assert manifest["search"]["k"] == 2 and manifest["rollout"]["max_turns"] == 2
    assert manifest["seeds"] == [0] and "torch" in manifest["versions"]
    assert set(manifest["stages"]) == set(stages) - {"report"}
    assert all(s["seconds"] > 0 and s["config"] for s in manifest["stages"].values())
    # how much of the CPU other processes took while each stage ran (Linux), shown beside its time
    assert all(0 <= s["others_cpu"] <= 1 for s in manifest["stages"].values())
    md = (root / "report.md").read_text()
    assert "| stage | minutes | other processes' CPU |" in md
    sentences = md.split("Sentences:")[1].split("###")[0]
    assert sum(line.startswith("- ") for line in sentences.splitlines()) == len(report["comparisons"])
    # what each arm changes, the levels every interval covers, and which code ran each stage
    assert set(report["arms"]) == arms and "`search.engine=bm25`" in report["arms"]["real"]
    assert all(row["em_levels"] in ("questions", "exact binomial") for row in report["rows"])
    assert manifest["code"]["version"] and all(
        s["code"] == manifest["code"] for s in manifest["stages"].values()
    )
    assert (root / "report.png").stat().st_size > 1000

    # MLflow: one parent run, every job run nested under it
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["exp"], output_format="list")
    (parent,) = [r for r in runs if r.data.tags.get("zerosim.job") == "experiment"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    jobs = sorted(r.data.tags.get("zerosim.job", "?") for r in children)
    assert jobs.count("train") == 4 and jobs.count("eval") == 7, jobs
    assert "report.png" in {a.path for a in mlflow.MlflowClient().list_artifacts(parent.info.run_id)}

    # an interim report of the finished evaluations: beside the experiment's own, no MLflow run, no stage
    written = (root / "report.json").read_bytes()
    interim = zerosim_cli("experiment", "--config", config, "--interim")
    assert "Interim: 7 of 7 evaluations finished" in interim.output and "| seed | EM |" in interim.output
    partial = json.loads((root / "interim" / "report.json").read_text())
    assert {(r["arm"], r["em"]) for r in partial["rows"]} == {(r["arm"], r["em"]) for r in report["rows"]}
    mixed = root / "stages" / "eval-mixed-s0-bm25" / "stage.json"
    kept = mixed.read_bytes()
    mixed.unlink()  # as while that evaluation still runs
    interim = zerosim_cli("experiment", "--config", config, "--interim")
    assert "Interim: 6 of 7 evaluations finished" in interim.output
    assert "Still to come: eval-mixed-s0-bm25" in interim.output
    partial = json.loads((root / "interim" / "report.json").read_text())
    assert "mixed" not in {r["arm"] for r in partial["rows"]} and partial["interim"]["to_come"] == [
        "eval-mixed-s0-bm25"
    ]
    assert "eval-mixed-s0-bm25" not in partial["manifest"]["stages"]  # only current stages' records
    assert "train-mixed-s0" in partial["manifest"]["stages"]
    mixed.write_bytes(kept)
    refused = zerosim_cli("experiment", "--config", config, "--interim", "--dry-run", code=None)
    assert refused.exit_code != 0 and "runs alone" in refused.output
    assert (root / "report.json").read_bytes() == written
    assert len(mlflow.search_runs(experiment_names=["exp"], output_format="list")) == len(runs)

    # the same experiment again (in process, as the command runs it): every stage reused, nothing re-run
    from zerosim.experiment import load_experiment, run_experiment

    # ... and a reused training stage loses the checkpoints a kill after its record (or older code) left
    run = root / "stages" / "train-real-s0" / "real"
    for left in ("checkpoint-3", ".deleting-checkpoint-2"):
        (run / left).mkdir()
        (run / left / "trainer_state.json").write_text("{}")
    again = run_experiment(load_experiment(config), echo=lambda line: None)
    assert again.ran == [] and set(again.reused) == set(stages)
    assert _stages(root) == stages
    assert not (run / "checkpoint-3").exists() and not (run / ".deleting-checkpoint-2").exists()
    assert (run / "final" / "config.json").is_file()

    # a changed arm re-runs that arm (training, eval) and the report only
    cfg = yaml.safe_load(config.read_text())
    cfg["arms"] = {"mixed": {"overrides": [
        "search.engine=mixed", "search.simulator.model={simulator}", "search.mixed.real=bm25",
        "search.mixed.real_share=1.0",
    ]}}  # fmt: skip
    config.write_text(yaml.safe_dump(cfg))
    changed = run_experiment(load_experiment(config), echo=lambda line: None)
    after = _stages(root)
    rerun = {name for name in after if after[name]["finished"] != stages[name]["finished"]}
    assert set(changed.ran) == rerun
    # the tiny policy learns nothing in 2 steps: the re-trained arm wrote the very weights its evaluation read,
    # so the evaluation (and the report from it) stands (tests: ..._re_made_with_the_weights_its_readers_read)
    same = (
        after["train-mixed-s0"]["model"]["sha256"] == after["eval-mixed-s0-bm25"]["reads"]["train-mixed-s0"]
    )
    assert rerun == ({"train-mixed-s0"} if same else {"train-mixed-s0", "eval-mixed-s0-bm25", "report"})


def test_train_launcher_runs_the_stage_as_a_command(tmp_path, mlflow_db):
    """`train_launcher` (e.g. `accelerate launch ...`) gets `-m zerosim.cli train --config <stage>/train.yaml`,
    and the stage's outputs are read from what that job wrote."""
    import mlflow

    from zerosim.core.config import load_config
    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.kinds import Stage, launch_grace, run_stage
    from zerosim.training.config import TrainConfig

    client = mlflow.MlflowClient(mlflow_db)
    run_id = client.create_run(client.create_experiment("train")).info.run_id
    fake = tmp_path / "launcher.py"
    fake.write_text(
        "import json, sys, pathlib, yaml\n"
        "args = sys.argv[1:]\n"
        "cfg = yaml.safe_load(pathlib.Path(args[args.index('--config') + 1]).read_text())\n"
        "out = pathlib.Path(cfg['run']['output_dir']) / cfg['run']['name']\n"
        "(out / 'final').mkdir(parents=True)\n"
        "(out / 'final' / 'config.json').write_text('{}')\n"
        f"(out / 'result.json').write_text(json.dumps({{'run_id': '{run_id}', 'steps': 7, 'final': True}}))\n"
        "(out / 'argv.json').write_text(json.dumps(args))\n"
        "import os; (out / 'grace').write_text(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])\n"
    )
    out = tmp_path / "stages" / "train-real-s0"
    train = load_config(
        None,
        [f"run.output_dir={out}", "run.name=real", f"tracking.tracking_uri={mlflow_db}"],
        schema=TrainConfig,
    )
    cfg = ExperimentConfig(train_launcher=f"{sys.executable} {fake} --num_processes 2")
    result = run_stage(Stage("train-real-s0", "train", train, []), tmp_path, cfg, parent=None)
    argv = json.loads((out / "real" / "argv.json").read_text())
    assert argv == ["--num_processes", "2", "-m", "zerosim.cli", "train", "--config", str(out / "train.yaml")]
    # the steps the job took, as it reports them (not the recipe's max_steps)
    assert result == {"path": str(out / "real" / "final"), "run_id": run_id, "steps": 7}
    written = load_config(out / "train.yaml", schema=TrainConfig)
    assert written.run.output_dir == str(out) and written.run.resume is False
    # torchrun's wait between its SIGTERM and its SIGKILL: a step and a checkpoint of the plan, not its 30 s
    grace = int((out / "real" / "grace").read_text())
    assert grace == launch_grace(train, argv) and grace >= 60


def test_a_launched_stage_that_stopped_cleanly_stops_the_experiment_resumable(tmp_path, mlflow_db):
    """torchrun and `accelerate launch` exit 1 when their ranks exit 143 after a clean stop (SIGTERM, STOP):
    the job's stopped.json tells the stop from a failure, so the experiment stops with 143 too (run it again
    to resume), and a failure without it stays a failure."""
    from zerosim.core.config import load_config
    from zerosim.core.signals import EXIT_CODE, Terminated
    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.kinds import Stage, run_stage
    from zerosim.training.config import TrainConfig

    fake = tmp_path / "launcher.py"
    fake.write_text(
        "import json, sys, pathlib, yaml\n"
        "args = sys.argv[1:]\n"
        "cfg = yaml.safe_load(pathlib.Path(args[args.index('--config') + 1]).read_text())\n"
        "out = pathlib.Path(cfg['run']['output_dir']) / cfg['run']['name']\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "if '--stop' in args: (out / 'stopped.json').write_text(json.dumps({'step': 2, 'reason': 'SIGTERM'}))\n"
        "sys.exit(1)\n"
    )
    out = tmp_path / "stages" / "train-real-s0"
    train = load_config(
        None,
        [f"run.output_dir={out}", "run.name=real", f"tracking.tracking_uri={mlflow_db}"],
        schema=TrainConfig,
    )
    stage = Stage("train-real-s0", "train", train, [])
    with pytest.raises(Terminated, match=r"stopped cleanly .*step.: 2.*run the experiment again") as stop:
        run_stage(
            stage, tmp_path, ExperimentConfig(train_launcher=f"{sys.executable} {fake} --stop"), parent=None
        )
    assert stop.value.code == EXIT_CODE
    with pytest.raises(
        RuntimeError, match=r"training stage failed \(exit code 1\)"
    ):  # an old stopped.json is cleared
        run_stage(stage, tmp_path, ExperimentConfig(train_launcher=f"{sys.executable} {fake}"), parent=None)


def test_train_launcher_keeps_the_users_own_shutdown_timeout(tmp_path, mlflow_db, monkeypatch):
    from zerosim.core.config import load_config
    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.kinds import Stage, run_stage
    from zerosim.training.config import TrainConfig

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "900")
    fake = tmp_path / "launcher.py"
    fake.write_text("import os, sys; sys.exit(int(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']) % 256)\n")
    out = tmp_path / "stages" / "train-real-s0"
    train = load_config(
        None,
        [f"run.output_dir={out}", "run.name=real", f"tracking.tracking_uri={mlflow_db}"],
        schema=TrainConfig,
    )
    cfg = ExperimentConfig(train_launcher=f"{sys.executable} {fake}")
    with pytest.raises(RuntimeError, match=f"exit code {900 % 256}"):
        run_stage(Stage("train-real-s0", "train", train, []), tmp_path, cfg, parent=None)


@pytest.mark.parametrize(
    ("job", "message"),
    [
        # a launcher that runs nothing (`train_launcher=/bin/true`)
        ("pass", "exited 0 but left no result.json"),
        # a job that wrote its result but no final model
        ("(out / 'result.json').write_text(json.dumps({'run_id': 'x', 'steps': 1}))", "left no final model"),
        # a final model, but its MLflow run is in another store
        (
            "(out / 'final').mkdir(); (out / 'final' / 'config.json').write_text('{}'); "
            "(out / 'result.json').write_text(json.dumps({'run_id': 'f' * 32, 'steps': 1}))",
            "does not hold",
        ),
    ],
    ids=["nothing", "no-final", "no-mlflow-run"],
)
def test_a_launcher_that_exits_0_without_training_is_not_a_finished_stage(tmp_path, mlflow_db, job, message):
    from zerosim.core.config import load_config
    from zerosim.experiment import ExperimentConfig
    from zerosim.experiment.kinds import Stage, run_stage
    from zerosim.training.config import TrainConfig

    fake = tmp_path / "launcher.py"
    fake.write_text(
        "import json, sys, pathlib, yaml\n"
        "args = sys.argv[1:]\n"
        "cfg = yaml.safe_load(pathlib.Path(args[args.index('--config') + 1]).read_text())\n"
        "out = pathlib.Path(cfg['run']['output_dir']) / cfg['run']['name']\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        f"{job}\n"
    )
    out = tmp_path / "stages" / "train-real-s0"
    train = load_config(
        None,
        [f"run.output_dir={out}", "run.name=real", f"tracking.tracking_uri={mlflow_db}"],
        schema=TrainConfig,
    )
    cfg = ExperimentConfig(train_launcher=f"{sys.executable} {fake}")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        run_stage(Stage("train-real-s0", "train", train, []), tmp_path, cfg, parent=None)


def test_stage_keys_follow_what_a_stage_depends_on(tmp_path):
    """Keys ignore where runs are logged; a changed arm changes its stages' keys and the report's only; a
    changed simulator recipe changes everything that reads the simulator."""
    from zerosim.experiment import build_stages, load_experiment

    def keys(*overrides):
        cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides])
        return {s.name: s.key for s in build_stages(cfg, tmp_path / "root")}

    base = keys()
    assert keys("tracking.tracking_uri=sqlite:////elsewhere/mlflow.db", "tracking.experiment=other") == base
    changed = keys("arms.real.overrides=[search.engine=bm25,curriculum.p_end=0.1]")
    assert {n for n in base if changed[n] != base[n]} == {"train-real-s0", "eval-real-s0-bm25", "report"}
    sim = keys("simulator.sft=[max_steps=3,batch_size=2,max_length=256]")
    assert {n for n in base if sim[n] != base[n]} == {
        "sim-sft", "sim-dpo", "sim-quality", "train-sim-s0", "train-sim-nocurriculum-s0", "train-mixed-s0",
        "eval-sim-s0-bm25", "eval-sim-nocurriculum-s0-bm25", "eval-mixed-s0-bm25", "report",
    }  # fmt: skip


def test_a_warm_start_is_keyed_by_its_own_settings_not_the_rl_recipe(tmp_path):
    """The warm start shares its config with the RL recipe but reads only warmstart.*, the policy and the seed:
    a new learning rate or validation split re-keys the training stages and leaves the warm start (and the
    evaluation of it) alone; a warm-start setting re-keys it and everything after it."""
    from dataclasses import replace

    from zerosim.experiment import build_stages, load_experiment

    def keys(*overrides, recipe=()):
        cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides])
        cfg = replace(cfg, overrides=[*cfg.overrides, *recipe])  # the preset's own overrides kept
        return {s.name: s.key for s in build_stages(cfg, tmp_path / "root")}

    base = keys()
    recipe = keys(recipe=["trainer.learning_rate=0.5", "validation.max_examples=7"])
    assert recipe["warmstart"] == base["warmstart"]
    assert recipe["eval-none-s0-bm25"] == base["eval-none-s0-bm25"]
    assert recipe["train-real-s0"] != base["train-real-s0"]
    warm = keys("warmstart=[warmstart.max_steps=7]")
    assert warm["warmstart"] != base["warmstart"]
    assert warm["eval-none-s0-bm25"] != base["eval-none-s0-bm25"]
    assert warm["train-real-s0"] != base["train-real-s0"]
    assert keys(recipe=["run.seed=5"])["warmstart"] != base["warmstart"]


def test_the_warm_start_key_names_everything_the_warm_start_reads():
    """A tripwire for WARMSTART_READS: the warm start is handed its own section, the policy's name and the
    seed (and where to log); a new parameter, or a new policy setting it might read, must be added to the
    key's list or the experiment reuses a warm start made under other settings."""
    import dataclasses
    import inspect

    from zerosim.experiment.kinds import WARMSTART_READS, _warmstart
    from zerosim.training.config import PolicyConfig
    from zerosim.training.warmstart import _run_warmstart as run_warmstart  # run_warmstart: it, under a lock

    assert WARMSTART_READS == (
        "warmstart.", "policy.model", "run.seed", "rollout.protocol", "rollout.tools", "rollout.max_turns",
        "rollout.max_page_tokens",
    )  # fmt: skip
    assert list(inspect.signature(run_warmstart).parameters) == [
        "cfg", "policy", "seed", "tracking", "output_dir", "engine", "rollout"
    ], "run_warmstart takes a new input: key it in WARMSTART_READS (zerosim/experiment/kinds.py)"  # fmt: skip
    source = inspect.getsource(_warmstart)
    handed = (
        "c.warmstart,",
        "policy=c.policy.model,",
        "seed=c.run.seed,",
        "tracking=c.tracking,",
        "rollout=c.rollout",
    )
    for one in handed:
        assert one in source, one
    assert source.count("c.") == 5, "the warm-start stage reads another setting: key it in WARMSTART_READS"
    # of the rollout section it reads the protocol and the tools (zerosim.training.warmstart.build_examples)
    from zerosim.training import warmstart

    reads = set(re.findall(r"(?<![\w.~])rollout\.(\w+)", inspect.getsource(warmstart.build_examples)))
    reads |= set(re.findall(r"(?<![\w.~])rollout\.(\w+)", inspect.getsource(warmstart._open_page)))
    assert reads == {"protocol", "tools", "max_turns", "max_page_tokens"}, reads
    # policy.lora is the RL job's (the warm start is a full SFT whatever it says): not in WARMSTART_READS
    assert {f.name for f in dataclasses.fields(PolicyConfig)} == {"model", "dtype", "lora"}, (
        "a new policy setting: if the warm start reads it, add it to WARMSTART_READS"
    )


def test_another_experiments_warm_start_keyed_under_older_rules_is_imported(tmp_path):
    """An export's warm start whose record key still covered the RL recipe (another learning rate) did this
    experiment's warm-start work: it is imported; one with other warm-start settings is not."""
    from dataclasses import replace

    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.kinds import STAGE_FILE
    from zerosim.experiment.run import plain as _plain
    from zerosim.experiment.transfer import export_results, plan_import

    cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}"])
    stages = build_stages(cfg, tmp_path / "here")
    warm = next(s for s in stages if s.name == "warmstart")

    def exported(config, folder):
        here = tmp_path / folder
        warm.dir(here).mkdir(parents=True)
        record = {"name": "warmstart", "kind": "warmstart", "key": "keyed-with-the-rl-recipe", "deps": [],
                  "finished": "2026-01-01T00:00:00", "outputs": {}, "meta": {},
                  "config": json.loads(json.dumps(_plain(config), default=str))}  # fmt: skip
        (warm.dir(here) / STAGE_FILE).write_text(json.dumps(record))
        export_results([warm], here, tmp_path / f"{folder}-export", name="recipe-sweep")
        return tmp_path / f"{folder}-export"

    c = warm.config
    other_lr = exported(replace(c, trainer=replace(c.trainer, learning_rate=0.5)), "lr")
    assert [s.name for s in plan_import(stages, tmp_path / "v2", other_lr, name="ablation")] == ["warmstart"]
    other_warm = exported(replace(c, warmstart=replace(c.warmstart, max_steps=7)), "warm")
    assert plan_import(stages, tmp_path / "v2b", other_warm, name="ablation") == []


def test_serve_overrides_reach_the_simulator_arms_only(tmp_path):
    """``simulator.serve`` sets search.simulator.* in every arm that trains against the simulator: those arms
    (and what evaluates them) re-key; the real-search arm, the warm start and the simulator stages do not."""
    from zerosim.experiment import build_stages, load_experiment

    def stages(*overrides):
        cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides])
        return {s.name: s for s in build_stages(cfg, tmp_path / "root")}

    base = stages()
    served = stages("simulator.serve=[hint_min_coverage=0.5]")
    assert {n for n in base if served[n].key != base[n].key} == {
        "train-sim-s0", "train-sim-nocurriculum-s0", "train-mixed-s0",
        "eval-sim-s0-bm25", "eval-sim-nocurriculum-s0-bm25", "eval-mixed-s0-bm25", "report",
    }  # fmt: skip
    for name in ("train-sim-s0", "train-sim-nocurriculum-s0", "train-mixed-s0"):
        assert served[name].config.search.simulator.hint_min_coverage == 0.5
    assert served["train-real-s0"].config.search.simulator.hint_min_coverage == 0.0
    # the full key is accepted too
    prefixed = stages("simulator.serve=[search.simulator.hint_min_coverage=0.5]")
    assert {n: s.key for n, s in prefixed.items()} == {n: s.key for n, s in served.items()}


def test_a_stage_whose_record_shows_todays_work_is_reused_whatever_key_it_was_written_with(tmp_path):
    """Records written under other keying rules (here: every stored key scrambled) and with a former default
    that computes what today's does are reused; a record of other work, or one whose dependency finished after
    it (re-run since), is not."""
    from dataclasses import replace

    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.keys import status
    from zerosim.experiment.kinds import STAGE_FILE
    from zerosim.experiment.run import plain as _plain

    root = tmp_path / "root"
    cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}"])
    stages = build_stages(cfg, root)
    by_name = {s.name: s for s in stages}

    def record(stage, *, key, finished="2026-01-01T00:00:00+0000", config=None):
        stage.dir(root).mkdir(parents=True, exist_ok=True)
        plain = json.loads(json.dumps(_plain(config or stage.config), default=str))
        if stage.kind == "train":  # written before the encoder default became unset
            plain["search"]["dense"]["encoder"] = "minilm"
        written = {"key": key, "meta": stage.meta, "finished": finished, "config": plain, "outputs": {}}
        (stage.dir(root) / STAGE_FILE).write_text(json.dumps(written))

    for stage in stages:
        record(stage, key="written-under-older-rules")
    assert {status(s, root, stages) for s in stages} == {"reuse"}
    assert status(by_name["train-real-s0"], root) == "re-run"  # without the other records it cannot tell

    # other work: a setting that differs from what would run now
    real = by_name["train-real-s0"]
    other = replace(real.config, trainer=replace(real.config.trainer, learning_rate=0.5))
    record(real, key="written-under-older-rules", config=other)
    assert status(real, root, stages) == "re-run"
    assert status(by_name["eval-real-s0-bm25"], root, stages) == "re-run"  # it read that other policy
    record(real, key="written-under-older-rules")
    assert status(by_name["eval-real-s0-bm25"], root, stages) == "reuse"

    # a dependency re-run after the stage finished: the stage read an older result
    record(real, key=real.key, finished="2026-06-01T00:00:00+0000")
    assert status(real, root, stages) == "reuse"
    assert status(by_name["eval-real-s0-bm25"], root, stages) == "re-run"


def test_a_part_run_evaluates_as_the_whole_experiment_does(tmp_path):
    """A part of an experiment run alone (seeds=[1]) keys its stages as the whole one (seeds=[0, 1]) does, so
    its exported results import into it: evaluations are seeded by eval.seed, not by the first of seeds
    (here with eval.limit, where the seed draws the questions)."""
    from zerosim.experiment import build_stages, load_experiment

    def keys(*overrides):
        cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides])
        return {s.name: s.key for s in build_stages(cfg, tmp_path / "root")}

    whole, part = keys("seeds=[0,1]"), keys("seeds=[1]")
    for name in ("train-real-s1", "eval-real-s1-bm25", "eval-sim-s1-bm25", "baseline-rag-bm25"):
        assert part[name] == whole[name], name
    assert keys("eval.seed=5")["eval-real-s0-bm25"] != keys()["eval-real-s0-bm25"]  # the sample it draws


def _older_record(stage, root: Path, *, config=None, finished="2026-01-01T00:00:00+0000", **fields) -> None:
    """Write ``stage``'s record as an older release would have (a key of other rules), with its config (or
    ``config``) and ``fields`` (``reads``, ``model``)."""
    from zerosim.experiment.kinds import STAGE_FILE
    from zerosim.experiment.run import plain

    config = stage.config if config is None else config
    written = None if config is None else json.loads(json.dumps(plain(config), default=str))
    record = {
        "key": "older-rules",
        "meta": stage.meta,
        "finished": finished,
        "config": written,
        "outputs": {},
    }
    stage.dir(root).mkdir(parents=True, exist_ok=True)
    (stage.dir(root) / STAGE_FILE).write_text(json.dumps({**record, **fields}))


def test_a_greedy_evaluation_of_every_question_is_keyed_without_its_seed(tmp_path):
    """An experiment's evaluations are greedy; over every question (eval.limit unset) with a real retriever
    they read their seed nowhere (tests/test_eval_harness.py shows it), so the key leaves it out — a record
    written with another eval seed is reused — while a sampled subset (eval.limit) keeps it."""
    from dataclasses import replace

    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.keys import status

    def stages(*overrides):
        cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides])
        return {s.name: s for s in build_stages(cfg, tmp_path / "root")}

    every = "eval.limit=null"
    seed = "eval.overrides=[seed=3]"  # what eval.seed sets
    now, seeded = stages(every), stages(every, seed)
    sample, sample_seeded = stages(), stages(seed)
    for name in ("eval-real-s0-bm25", "baseline-direct-none", "baseline-rag-bm25"):
        assert seeded[name].key == now[name].key, name
        assert sample_seeded[name].key != sample[name].key, name

    # a record of the same greedy evaluation run with seed 3 (a part run under the old seeding) is reused
    root = tmp_path / "root"
    evaluated = now["eval-real-s0-bm25"]
    for stage in now.values():
        _older_record(stage, root)
    _older_record(evaluated, root, config=replace(evaluated.config, seed=3))
    assert status(evaluated, root, list(now.values())) == "reuse"
    _older_record(evaluated, root, config=replace(evaluated.config, seed=3, limit=8))
    assert status(evaluated, root, list(now.values())) == "re-run"


def test_a_model_re_made_with_the_weights_its_readers_read_keeps_them_reused(tmp_path):
    """Stages keyed under older rules are reused by what their records show; a warm start re-made after them
    (its model was not here) with the very weights they record having read leaves them reused — with other
    weights, they run again."""
    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.keys import status

    root = tmp_path / "root"
    cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}"])
    stages = build_stages(cfg, root)
    digest = {s.name: f"{i:064x}" for i, s in enumerate(stages)}

    def record(stage, *, finished="2026-01-01T00:00:00+0000", wrote=None):
        reads = {d: digest[d] for d in stage.deps}
        _older_record(
            stage, root, finished=finished, reads=reads, model={"sha256": wrote or digest[stage.name]}
        )

    for stage in stages:
        record(stage)
    warm = next(s for s in stages if s.name == "warmstart")
    readers = [s for s in stages if "warmstart" in s.deps]
    assert readers and {status(s, root, stages) for s in readers} == {"reuse"}
    record(warm, finished="2026-06-01T00:00:00+0000")  # re-made: the same weights
    assert {status(s, root, stages) for s in readers} == {"reuse"}
    record(warm, finished="2026-06-01T00:00:00+0000", wrote="f" * 64)  # other weights
    assert {status(s, root, stages) for s in readers} == {"re-run"}


SNAPSHOT = ROOT / "tests" / "snapshots" / "stage_key_defaults.json"


def test_stage_key_defaults_are_pinned():
    """A stage's key holds only its settings that differ from their defaults, so a changed default would let a
    finished stage be reused although it computed something else. Any change to a default (or a new setting)
    fails here until the snapshot is rewritten: `ZEROSIM_UPDATE_SNAPSHOTS=1 pytest tests/test_experiment.py -k
    pinned`, with `KEY_DEFAULTS_VERSION` bumped where the change alters what a stage computes."""
    import os

    from zerosim.experiment.keys import KEY_DEFAULTS_VERSION, schema_defaults, stage_schemas

    current = {
        "version": KEY_DEFAULTS_VERSION,
        "defaults": {s.__name__: schema_defaults(s) for s in sorted(set(stage_schemas().values()), key=str)},
    }
    if os.environ.get("ZEROSIM_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(json.dumps(current, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(SNAPSHOT.read_text())
    differences = []
    for schema, defaults in current["defaults"].items():
        old = pinned["defaults"].get(schema, {})
        for key in sorted(set(defaults) | set(old)):
            if defaults.get(key, "<missing>") != old.get(key, "<missing>"):
                differences.append(
                    f"{schema}.{key}: {old.get(key, '<missing>')!r} -> {defaults.get(key, '<missing>')!r}"
                )
    assert not differences and pinned["version"] == KEY_DEFAULTS_VERSION, (
        "stage-key defaults changed:\n  "
        + "\n  ".join(differences)
        + "\nA changed default that changes what a "
        "stage computes needs KEY_DEFAULTS_VERSION bumped (zerosim/experiment/keys.py); a new setting whose default "
        "changes nothing needs no bump. Then rewrite the snapshot: ZEROSIM_UPDATE_SNAPSHOTS=1 pytest "
        "tests/test_experiment.py -k pinned"
    )


def test_a_new_setting_at_its_default_re_keys_no_stage(tmp_path, monkeypatch):
    """A release that adds settings (top-level or nested) at defaults re-keys no finished stage; setting the
    new one in one arm re-keys that arm and the report only."""
    from dataclasses import dataclass, field, replace

    import zerosim.experiment as experiment
    import zerosim.experiment.kinds as kinds
    import zerosim.experiment.stages as stages
    from zerosim.engines import SearchConfig
    from zerosim.job_config import EvalConfig
    from zerosim.training.config import TrainConfig

    def keys(*overrides):
        cfg = experiment.load_experiment(
            SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", *overrides]
        )
        return {s.name: s.key for s in experiment.build_stages(cfg, tmp_path / "root")}

    base = keys()

    @dataclass
    class NextSearch(SearchConfig):
        new_filter: float = 0.0

    @dataclass
    class NextTrain(TrainConfig):
        search: NextSearch = field(default_factory=NextSearch)
        new_knob: bool = False

    @dataclass
    class NextEval(EvalConfig):
        search: NextSearch = field(default_factory=lambda: NextSearch(engine="bm25"))

    monkeypatch.setattr(stages, "TrainConfig", NextTrain)
    monkeypatch.setattr(stages, "EvalConfig", NextEval)
    for kind, schema in {"warmstart": NextTrain, "train": NextTrain, "eval": NextEval}.items():
        monkeypatch.setitem(kinds.KINDS, kind, replace(kinds.KINDS[kind], schema=schema))
    assert keys() == base
    changed = keys("arms.real.overrides=[search.engine=bm25,search.new_filter=0.5]")
    assert {n for n in base if changed[n] != base[n]} == {"train-real-s0", "eval-real-s0-bm25", "report"}


def test_estimates_learn_only_from_stages_timed_on_a_quiet_machine(tmp_path):
    """A stage timed beside other CPU-bound work (or in an older record without the measurement) does not
    set the rate the dry run estimates with; one timed on a quiet machine does."""
    from zerosim.core.runtime import CPUTimes, others_cpu_share
    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.estimates import estimates
    from zerosim.experiment.kinds import RATES

    # 20 s of wall on 2 cores; this process used 25 CPU seconds and the machine 35: others took 10 of 40
    start, end = CPUTimes(100.0, 5.0, 2, 0.0), CPUTimes(135.0, 30.0, 2, 20.0)
    assert others_cpu_share(start, end) == pytest.approx(0.25)
    assert others_cpu_share(None, end) is None

    root = tmp_path / "root"
    cfg = load_experiment(SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}"])
    stages = build_stages(cfg, root)
    sft = next(s for s in stages if s.kind == "sft")
    shipped = estimates(stages, root)[sft.name]
    assert shipped == pytest.approx(sft.estimate_s)

    def finished(seconds, **extra):
        sft.dir(root).mkdir(parents=True, exist_ok=True)
        record = {"key": sft.key, "seconds": seconds, "outputs": {"path": "x"}, **extra}
        (sft.dir(root) / "stage.json").write_text(json.dumps(record))

    slow = 15.0 + 100 * RATES["sft"] * sft.config.max_steps
    finished(slow, others_cpu=0.6)  # contended: 100x the quiet rate
    assert estimates(stages, root)[sft.name] == pytest.approx(shipped)
    finished(slow)  # no measurement (an older record)
    assert estimates(stages, root)[sft.name] == pytest.approx(shipped)
    finished(slow, others_cpu=0.02, attempts=2)  # continued after a kill: its time holds work done twice
    assert estimates(stages, root)[sft.name] == pytest.approx(shipped)
    finished(slow, others_cpu=0.02)  # quiet: this machine is that slow
    assert estimates(stages, root)[sft.name] == pytest.approx(slow)


def test_a_continued_stage_counts_the_time_of_the_attempt_that_was_killed(tmp_path):
    """While a stage runs, its time so far is kept beside it; a continued stage adds the killed attempt's time
    (to within the save interval) to its own and counts the attempts; a fresh run starts from zero."""
    from zerosim.experiment.run import ATTEMPT_FILE, StageClock

    folder = tmp_path / "stage"
    with StageClock(folder, continuing=False, every=0.02) as clock:
        time.sleep(0.2)
        kept = json.loads((folder / ATTEMPT_FILE).read_text())  # saved while running, not only at the end
        assert 0.05 < kept["seconds"] <= clock.seconds() and kept["attempts"] == 1
    first = clock.seconds()
    assert first >= 0.2 and clock.attempts == 1
    assert clock.seconds() == first  # stopped at exit

    # a killed attempt left its time behind; continuing adds to it
    (folder / ATTEMPT_FILE).write_text(json.dumps({"seconds": 100.0, "attempts": 1}))
    with StageClock(folder, continuing=True) as clock:
        time.sleep(0.05)
    assert clock.attempts == 2 and 100.05 <= clock.seconds() < 101
    assert json.loads((folder / ATTEMPT_FILE).read_text())["attempts"] == 2

    with StageClock(folder, continuing=False) as clock:  # a re-run: the earlier attempts are not its own
        pass
    assert clock.attempts == 1 and clock.seconds() < 1


def test_results_travel_by_export_and_import(tiny_experiment):
    """Export the finished stages (no models), import them into a fresh output directory on "another
    machine": the experiment finishes there with the same report, re-running nothing whose results came
    along; a stage whose evaluation did not come along runs again, with the training it reads."""
    import shutil

    from zerosim.core.config import ConfigError
    from zerosim.experiment import build_stages, load_experiment, run_experiment
    from zerosim.experiment.run import statuses
    from zerosim.experiment.transfer import export_results, import_results

    config, tmp_path = tiny_experiment
    fewer = ["arms.mixed.enabled=false", "arms.sim-nocurriculum.enabled=false"]
    here = load_experiment(config, fewer)
    first = run_experiment(here, echo=lambda line: None)
    out = tmp_path / "export"
    written = export_results(
        build_stages(here, first.root),
        first.root,
        out,
        name=here.name,
        tracking_uri=here.tracking.tracking_uri,
    )
    assert "report" in written and "train-real-s0" in written
    # what to read when a score surprises travels too: each run's sample trajectories, each question's answer
    samples = out / "train-real-s0" / "mlflow" / "samples" / "trajectories.jsonl"
    assert samples.is_file() and json.loads(samples.read_text().splitlines()[0])
    assert (out / "eval-real-s0-bm25" / "mlflow" / "samples" / "trajectories.jsonl").is_file()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert not any("final" in p.parts or p.suffix == ".safetensors" for p in files)  # no model travels
    assert str(first.root) not in (out / "train-real-s0" / "stage.json").read_text()
    shutil.rmtree(out / "report")  # the report is written where the results meet

    there = load_experiment(config, [*fewer, f"output_dir={tmp_path / 'elsewhere'}"])
    root = tmp_path / "elsewhere" / there.name
    brought = import_results(build_stages(there, root), root, out, name=there.name)
    assert set(brought) == set(written) - {"report"}
    second = run_experiment(there, echo=lambda line: None)
    assert second.ran == ["report"]  # the models stayed behind: nothing that read them had to run
    for key in ("rows", "comparisons", "arms"):
        assert second.report[key] == first.report[key], key

    shutil.rmtree(out / "eval-real-s0-bm25")  # an evaluation that did not come along needs its model
    third = tmp_path / "third" / there.name
    stages = build_stages(there, third)
    import_results(stages, third, out, name=there.name)
    state = statuses(stages, third)
    assert state["eval-real-s0-bm25"] == "run"
    assert state["train-real-s0"] == state["warmstart"] == "re-run"  # what it reads, up the chain
    assert state["train-sim-s0"] == "reuse"  # its model is absent too, but every reader is reused

    with pytest.raises(ConfigError, match="export.json"):
        import_results(stages, third, tmp_path, name=there.name)
    # under another experiment's name only the stages that did this work come (same name, same key): here every
    # stage the export holds, since the settings are the same
    other = tmp_path / "other" / "other"
    assert set(import_results(stages, other, out, name="other")) == set(written) - {
        "report",
        "eval-real-s0-bm25",
    }

    # a folder moved elsewhere (copied, the original gone) reads its own files and logs under its own parent
    # run; its records hold no path of where it was
    moved = tmp_path / "moved" / here.name
    shutil.copytree(first.root, moved)
    shutil.rmtree(first.root)
    shutil.rmtree(moved / "stages" / "report")
    assert str(first.root) not in (moved / "stages" / "eval-real-s0-bm25" / "stage.json").read_text()
    fourth = run_experiment(
        load_experiment(config, [*fewer, f"output_dir={moved.parent}"]), echo=lambda line: None
    )
    assert fourth.ran == ["report"] and fourth.report["rows"] == first.report["rows"]
    assert fourth.parent_run_id != first.parent_run_id
    import mlflow

    assert mlflow.MlflowClient().get_run(first.parent_run_id).info.status == "FINISHED"


def test_one_experiment_folder_one_process(tiny_experiment):
    """A second `zerosim experiment` on a folder in use is refused at once, naming the process that holds it
    (two would run the same stages and clear each other's folders)."""
    import socket

    from zerosim.core.config import ConfigError
    from zerosim.experiment import load_experiment, run_experiment
    from zerosim.experiment.run import LOCK_FILE, OWNER_FILE

    config, tmp_path = tiny_experiment
    cfg = load_experiment(config)
    root = tmp_path / "experiments" / cfg.name
    root.mkdir(parents=True)
    (root / OWNER_FILE).write_text(json.dumps({"pid": 4242, "host": socket.gethostname()}))
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import filelock, time; held = filelock.FileLock({str(root / LOCK_FILE)!r}); held.acquire(); "
         "print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=r"in use by another zerosim experiment \(pid 4242 on "):
            run_experiment(cfg, echo=lambda line: None)
    finally:
        holder.kill()
        holder.wait()
    assert not (root / "stages").exists()  # refused before any stage


def test_the_curriculum_ablation_changes_one_thing_per_arm(tmp_path):
    """configs/experiments/curriculum-ablation-cpu.yaml: the fixed-noise arm asks for the curriculum's mean
    noise (computed from its schedule, not typed in) and differs from the curriculum arm in the schedule alone;
    every arm trains on fact-train and is scored on all of fact-test; the untrained arm is scored once."""
    from curricula import curriculum_schedule
    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.keys import changed_settings
    from zerosim.training.config import TrainConfig

    cfg = load_experiment(
        ROOT / "configs" / "experiments" / "curriculum-ablation-cpu.yaml", [f"output_dir={tmp_path}"]
    )
    stages = {s.name: s for s in build_stages(cfg, tmp_path / cfg.name)}
    curriculum, matched = (
        stages["train-sim-curriculum-s1"].config,
        stages["train-sim-fixed-matched-s1"].config,
    )
    steps = curriculum.trainer.max_steps
    schedule = curriculum_schedule(curriculum.curriculum, steps)
    mean = sum(schedule.probability(i) for i in range(steps)) / steps
    assert 0.05 < mean < 0.3 and matched.curriculum.p_end == pytest.approx(mean, rel=1e-5)
    differ = (
        changed_settings(matched, TrainConfig, missing=None).items()
        ^ changed_settings(curriculum, TrainConfig, missing=None).items()
    )
    assert {k for k, _ in differ} - {"run.name", "run.output_dir"} == {
        "curriculum.schedule",
        "curriculum.p_end",
    }
    assert "`curriculum.p_end=0.107165`" in ", ".join(
        f"`{c}`" for c in stages["train-sim-fixed-matched-s0"].changes
    )
    trains = [s for s in stages.values() if s.kind == "train"]
    assert len(trains) == 9 and all(s.config.data.split == "fact-train" for s in trains)
    assert [s.name for s in trains[:3]] == [
        "train-real-s0",
        "train-sim-curriculum-s0",
        "train-sim-fixed-matched-s0",
    ]
    evals = [s for s in stages.values() if s.kind == "eval"]
    assert len(evals) == 10 and sum(s.meta["arm"] == "none" for s in evals) == 1
    assert all(s.config.split == "fact-test" and s.config.limit is None for s in evals)
    assert stages["sim-collect"].config.split == "fact-train"
    assert cfg.report.pairs == ["sim-curriculum:sim-fixed-matched"]

    # the follow-up arms, once enabled: each differs from its arm in how step rewards are credited alone
    more = load_experiment(
        ROOT / "configs" / "experiments" / "curriculum-ablation-cpu.yaml",
        [f"output_dir={tmp_path}", "arms.sim-fixed-matched-prefix.enabled=true", "arms.sim-curriculum-prefix.enabled=true"],
    )  # fmt: skip
    built = {s.name: s.config for s in build_stages(more, tmp_path / more.name) if s.kind == "train"}
    for arm in ("sim-fixed-matched", "sim-curriculum"):
        base, prefix = built[f"train-{arm}-s0"], built[f"train-{arm}-prefix-s0"]
        differ = (
            changed_settings(prefix, TrainConfig, missing=None).items()
            ^ changed_settings(base, TrainConfig, missing=None).items()
        )
        assert {k for k, _ in differ} - {"run.name", "run.output_dir"} == {"reward.step_credit"}


def test_the_manifest_names_the_code_and_flags_stages_from_other_code():
    """Which code ran: the checkout's commit and whether tracked files differ from it (the package version
    outside a checkout); the report's stage table flags a stage recorded under other code."""
    from zerosim.core.tracking import code_version
    from zerosim.experiment.report import _code

    code = code_version()
    assert code["version"]
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert code["commit"] == head.stdout.strip() and isinstance(code["dirty"], bool)
    same = {"version": "0.1.0", "commit": "a" * 40, "dirty": False}
    assert _code(same, same) == "a" * 10
    assert "other code" in _code({**same, "commit": "b" * 40}, same)
    assert "uncommitted" in _code({**same, "dirty": True}, same)
    assert _code(None, same) == "not recorded"


def test_uncommitted_changes_are_recorded_by_their_diff(tmp_path):
    """A stage run on a dirty checkout says which code ran it: the digest of `git diff HEAD` in its code
    version (the diff itself is written beside its record, code.diff, and travels with it)."""
    import hashlib

    from zerosim.core.tracking import code_diff, code_version

    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    clean = code_version(tmp_path)
    assert clean["dirty"] is False and "diff_sha256" not in clean and code_diff(tmp_path) is None
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "untracked.py").write_text("y = 1\n")
    dirty, diff = code_version(tmp_path), code_diff(tmp_path)
    assert dirty["dirty"] is True and "-x = 1" in diff and "+x = 2" in diff and "untracked" not in diff
    assert dirty["diff_sha256"] == hashlib.sha256(diff.encode()).hexdigest()


def test_the_gpu_preset_trains_every_simulator_arm_against_its_simulator(tmp_path):
    """configs/experiments/zerosearch-qwen2.5-3b.yaml names a ready simulator (simulator.model): every arm whose
    searches the simulator answers — named in its overrides or not — is given it, with simulator.serve applied
    and, for one of ZeroSearch's released simulators, their prompt layout; the real arm gets none of it."""
    from zerosim.experiment import build_stages, load_experiment

    preset = ROOT / "configs" / "experiments" / "zerosearch-qwen2.5-3b.yaml"
    released = "sunhaonlp/Simulation_LLM_google_14B_V2"
    overrides = [
        f"output_dir={tmp_path}",
        "seeds=[0]",
        f"simulator.model={released}",
        "simulator.serve=[hint_min_coverage=0.5]",
    ]
    cfg = load_experiment(preset, overrides)
    stages = {s.name: s for s in build_stages(cfg, tmp_path / cfg.name)}
    assert not any(s.kind in ("collect", "sft", "dpo", "quality") for s in stages.values())  # a ready one
    for arm in ("sim", "sim-nocurriculum", "mixed"):
        sim = stages[f"train-{arm}-s0"].config.search.simulator
        assert (sim.model, sim.prompts, sim.hint_min_coverage) == (released, "zerosearch", 0.5), arm
    real = stages["train-real-s0"].config.search.simulator
    assert real.model != released and real.hint_min_coverage == 0.0
    # the preset's own simulator (a local folder, not a ZeroSearch release): given, in zerosim's layout
    own = load_experiment(preset, [f"output_dir={tmp_path}", "seeds=[0]"])
    sim = next(
        s for s in build_stages(own, tmp_path / own.name) if s.name == "train-sim-s0"
    ).config.search.simulator
    assert (sim.model, sim.prompts) == ("simulators/zerosearch-simulator-14b", "default")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"name": "x", "key": "k"', "damaged stage record"),  # cut short
        (b"\xff\xfe\x00garbage", "damaged stage record"),  # not text
        (b'["a", "list"]', "not a stage record (no key, outputs)"),
        (b'{"key": "k"}', "not a stage record (no outputs)"),
        (b'{"key": "k", "outputs": ["x"]}', "its outputs are not a mapping"),
    ],
    ids=["cut-short", "binary", "a-list", "no-outputs", "outputs-not-a-mapping"],
)
def test_a_damaged_stage_record_is_refused_naming_the_file_and_the_fix(tmp_path, content, message):
    """Read by the dry run and the run before any stage: a record that is not one is named with the way out,
    not an AttributeError, KeyError or UnicodeDecodeError."""
    from zerosim.core.config import ConfigError
    from zerosim.experiment.keys import status
    from zerosim.experiment.kinds import Stage

    stage = Stage("sim-collect", "collect", None, [])
    stage.dir(tmp_path).mkdir(parents=True)
    (stage.dir(tmp_path) / "stage.json").write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as refused:
        status(stage, tmp_path)
    assert str(stage.dir(tmp_path) / "stage.json") in str(refused.value)
    assert f"delete {stage.dir(tmp_path)} to run the stage again" in str(refused.value)


def test_no_simulator_stages_when_no_arm_trains_against_one(tmp_path):
    """A sweep over real retrievers (configs/experiments/recipe-sweep-cpu.yaml) builds no simulator: nothing reads
    it, and it would cost most of the run."""
    from zerosim.experiment import build_stages, load_experiment

    sweep = ROOT / "configs" / "experiments" / "recipe-sweep-cpu.yaml"
    cfg = load_experiment(
        sweep, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", f"output_dir={tmp_path}"]
    )
    names = [s.name for s in build_stages(cfg, tmp_path / cfg.name)]
    assert not [n for n in names if n.startswith("sim-")]
    assert "warmstart" in names and "train-base-s0" in names and "eval-none-s0-bm25" in names
    smoke = load_experiment(
        SMOKE, [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", f"output_dir={tmp_path}"]
    )
    assert "sim-sft" in [s.name for s in build_stages(smoke, tmp_path / smoke.name)]  # its sim arm needs one


def test_the_v2_ablation_imports_whole_into_a_fresh_folder(tmp_path, zerosim_cli, monkeypatch):
    """The exported v2 ablation (results/curriculum-ablation-v2-cpu, four sittings on one CPU kind) plans as
    finished in a folder that has none of it: every stage reused, the report too (its tables travel in the
    export). An export from before they travelled re-runs the report, whose reason — a path in brackets — prints
    as text, under <root>, instead of being read as rich markup and failing the dry run. Planned on a CPU that
    computes in bf16 by default (AVX512_BF16): the preset pins the fp32 its records ran in (runtime.bf16=false)."""
    import shutil

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(
        "zerosim.experiment.keys._this_machine", lambda: "AMD EPYC, 2 cores, AVX-512 with bf16 (no AMX)"
    )

    def plan(export):
        out = zerosim_cli(
            "experiment", "--config", "configs/experiments/curriculum-ablation-v2-cpu.yaml",
            "--import", export, "--dry-run", f"output_dir={tmp_path}",
        ).output  # fmt: skip
        status = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in out.splitlines()
                  if line.count("│") >= 4 and line.split("│")[1].strip() not in ("", "stage")}  # fmt: skip
        return out, status

    out, status = plan("results/curriculum-ablation-v2-cpu")
    assert len(status) == 47 and set(status.values()) == {"reuse"}, status

    older = tmp_path / "older-export"  # the same export without the report's files, as exports were before
    shutil.copytree(ROOT / "results" / "curriculum-ablation-v2-cpu", older)
    manifest = json.loads((older / "export.json").read_text())
    for name in ("report.json", "report.md", "report.png"):
        (older / "report" / name).unlink()
        manifest["files"]["report"].pop(name)
    (older / "export.json").write_text(json.dumps(manifest))
    out, status = plan(str(older))
    assert len(status) == 47 and status.pop("report") == "re-run"
    assert set(status.values()) == {"reuse"}
    assert (
        "<root>/report.json" in out.replace("\n", "").replace(" ", "") and "zerosim-import-preview" not in out
    )


def test_a_stage_key_holds_the_precision_decided_and_a_record_is_read_by_the_rules_of_its_time():
    """runtime.bf16 / trainer.bf16 (null: as the machine decides) enter a key as what they decide: bf16 markers
    where generation or the update run in bf16, nothing in fp32 (what keys held before); bf16 generation as it
    computes today (hi + lo weights), so a record of the one-weight copy before it is not reused. A record without
    runtime.bf16 generated in fp32 and updated in bf16 only on AMX with trainer.bf16 auto and beta 0."""
    from zerosim.experiment.keys import _with_precision

    bf16_cpu, avx512, amx = (
        "AMD EPYC, 2 cores, AVX-512 with bf16 (no AMX)", "AMD EPYC, 2 cores, AVX-512 (no AMX)", "Xeon, 2 cores, AMX",
    )  # fmt: skip
    auto = {"runtime.bf16": None, "trainer.bf16": None, "trainer.beta": 0.0}
    pinned = {**auto, "runtime.bf16": False}
    both = {"runtime.bf16": "hi+lo", "trainer.bf16": True}
    update = {"trainer.bf16": True}  # auto: the update in bf16, generation in fp32
    assert _with_precision("train", {}, auto, bf16_cpu, recorded=False) == update
    assert _with_precision("train", {}, {**auto, "runtime.bf16": True}, bf16_cpu, recorded=False) == both
    assert _with_precision("train", {}, auto, avx512, recorded=False) == {}
    assert _with_precision("train", {"runtime.bf16": False}, pinned, bf16_cpu, recorded=False) == {}
    assert _with_precision("train", {}, {**auto, "trainer.beta": 0.01}, amx, recorded=False) == {}
    assert _with_precision("train", {}, {**auto, "runtime.bf16": True, "trainer.beta": 0.01}, amx, recorded=False) == {"runtime.bf16": "hi+lo"}  # fmt: skip
    assert _with_precision("train", {"trainer.bf16": True}, {**pinned, "trainer.bf16": True}, avx512, recorded=False) == {"trainer.bf16": True}  # fmt: skip
    # records from before runtime.bf16: fp32 generation; the update as auto decided then (AMX, beta 0)
    before = {"trainer.bf16": None, "trainer.beta": 0.0}
    assert _with_precision("train", {}, before, avx512, recorded=True) == {}  # = the pinned preset's key
    assert _with_precision("train", {}, before, amx, recorded=True) == {"trainer.bf16": True}
    assert (
        _with_precision("train", {}, before, None, recorded=True) == {}
    )  # no machine recorded: as keyed then
    # a record with the setting is read on its machine
    assert _with_precision("train", {}, auto, bf16_cpu, recorded=True, commit="f" * 40) == update
    # ... and one the code of one bf16 weight per layer ran keeps that key: not today's work, re-run
    old = _with_precision(
        "train", {}, auto, bf16_cpu, recorded=True, commit="a0f201358638652b9a0000c0e63beb1c0a917799"
    )
    assert old == {"runtime.bf16": True, "trainer.bf16": True} != both
    assert _with_precision("eval", {}, {"runtime.bf16": None}, bf16_cpu, recorded=False) == {}
    assert _with_precision("eval", {}, {"runtime.bf16": True}, bf16_cpu, recorded=False) == {
        "runtime.bf16": "hi+lo"
    }
    assert _with_precision("eval", {}, {}, bf16_cpu, recorded=True) == {}
    # what does not generate or update ignores it; a GPU computes in the recipe's precision
    assert _with_precision("sft", {"runtime.bf16": True, "max_steps": 9}, {"runtime.bf16": True}, bf16_cpu, recorded=False) == {"max_steps": 9}  # fmt: skip
    gpu = "NVIDIA H100 80GB HBM3 (CUDA 12.8)"
    assert _with_precision("train", {"trainer.bf16": False}, {**auto, "trainer.bf16": False}, gpu, recorded=False) == {"trainer.bf16": False}  # fmt: skip


def test_an_arm_can_differ_by_protocol_alone(tmp_path):
    """configs/experiments/tool-protocol-cpu.yaml: the tools arm differs from the tags arm by rollout.protocol
    alone, starts from a warm start written in its protocol, and is evaluated rolling out as it trained; its
    untrained row evaluates that warm start. The tags arms are the v2 ablation's stages, key for key, and its
    export's finished ones (recorded under older key rules) are planned for import."""
    from zerosim.experiment import build_stages, load_experiment
    from zerosim.experiment.keys import changed_settings
    from zerosim.experiment.transfer import plan_import
    from zerosim.training.config import TrainConfig

    presets = ROOT / "configs" / "experiments"
    cfg = load_experiment(presets / "tool-protocol-cpu.yaml", [f"output_dir={tmp_path}"])
    stages = build_stages(cfg, tmp_path / cfg.name)
    by = {s.name: s for s in stages}
    tags, tools = by["train-real-s0"].config, by["train-tools-s0"].config
    differ = (
        changed_settings(tools, TrainConfig, missing=None).items()
        ^ changed_settings(tags, TrainConfig, missing=None).items()
    )
    assert {k for k, _ in differ} - {"run.name", "run.output_dir", "policy.model"} == {"rollout.protocol"}
    assert by["train-real-s0"].deps == ["warmstart"] and by["train-tools-s0"].deps == ["warmstart-tools"]
    assert tools.policy.model.endswith("/warmstart-tools/warmstart/final")
    reading = by["train-tools-read-page-s0"]
    assert reading.deps == ["warmstart-tools-search-read_page"] and reading.config.rollout.max_turns == 3
    reading_warm = by[
        "warmstart-tools-search-read_page"
    ].config.rollout  # its demonstrations read, as it trains
    assert (reading_warm.tools, reading_warm.max_turns, reading_warm.max_page_tokens) == (
        ["search", "read_page"],
        3,
        reading.config.rollout.max_page_tokens,
    )
    assert by["eval-none-tools-read-page-s0-bm25"].config.rollout.tools == ["search", "read_page"]
    warm = by["warmstart-tools"]
    assert warm.config.rollout.protocol == "tools" and warm.key != by["warmstart"].key
    assert by["eval-tools-s1-bm25"].config.rollout.protocol == "tools"
    assert by["eval-real-s1-bm25"].config.rollout.protocol == "tags"
    none_tools = by["eval-none-tools-s0-bm25"]
    assert none_tools.deps == ["warmstart-tools"] and none_tools.config.rollout.protocol == "tools"
    assert none_tools.config.rollout.temperature == 0.0

    v2 = load_experiment(presets / "curriculum-ablation-v2-cpu.yaml", [f"output_dir={tmp_path}"])
    v2_keys = {s.name: s.key for s in build_stages(v2, tmp_path / cfg.name)}  # the same root: keys comparable
    shared = ["warmstart", "eval-none-s0-bm25", "train-real-s0", "eval-real-s0-bm25", "train-real-s1"]
    assert {n: by[n].key for n in shared} == {n: v2_keys[n] for n in shared}
    planned = plan_import(stages, tmp_path / cfg.name, ROOT / "results" / v2.name, name=cfg.name)
    assert [s.name for s in planned] == [
        "warmstart",
        "eval-none-s0-bm25",
        "train-real-s0",
        "eval-real-s0-bm25",
        "train-real-s1",
        "eval-real-s1-bm25",
    ]


def test_an_untrained_arm_takes_rollout_settings_only(tmp_path):
    from zerosim.core.config import ConfigError
    from zerosim.experiment import load_experiment

    preset = ROOT / "configs" / "experiments" / "tool-protocol-cpu.yaml"
    with pytest.raises(ConfigError, match=r"arms.none-tools: an rl: false arm .*trainer.learning_rate=0.5"):
        load_experiment(
            preset, [f"output_dir={tmp_path}", "arms.none-tools.overrides=[trainer.learning_rate=0.5]"]
        )


def test_a_protocol_can_have_its_own_warm_start_budget(tmp_path):
    """warmstarts.tools reaches every tools warm start (search only, and with read_page) and no tags one: the
    tags arms keep the v2 ablation's warm start, key for key; a wrong key or a non-warmstart override is refused."""
    from zerosim.core.config import ConfigError
    from zerosim.experiment import build_stages, load_experiment

    preset = ROOT / "configs" / "experiments" / "tool-protocol-cpu.yaml"
    plain = {s.name: s for s in build_stages(*_loaded(preset, tmp_path, []))}
    by = {s.name: s for s in build_stages(*_loaded(preset, tmp_path, ["warmstarts={tools: [warmstart.max_steps=20]}"]))}  # fmt: skip
    assert by["warmstart"].key == plain["warmstart"].key and by["warmstart"].config.warmstart.max_steps == 5
    for name in ("warmstart-tools", "warmstart-tools-search-read_page"):
        assert by[name].config.warmstart.max_steps == 20 and by[name].key != plain[name].key
    assert by["train-tools-s0"].key != plain["train-tools-s0"].key  # it starts from another policy
    assert by["train-real-s0"].key == plain["train-real-s0"].key
    with pytest.raises(ConfigError, match=r"warmstarts.tool: keys are rollout protocols \(tags, tools\)"):
        load_experiment(preset, [f"output_dir={tmp_path}", "warmstarts={tool: [warmstart.max_steps=20]}"])
    with pytest.raises(ConfigError, match=r"warmstarts.tools has \['trainer.max_steps=3'\]"):
        load_experiment(preset, [f"output_dir={tmp_path}", "warmstarts={tools: [trainer.max_steps=3]}"])


def _loaded(preset, tmp_path, overrides):
    from zerosim.experiment import load_experiment

    cfg = load_experiment(preset, [f"output_dir={tmp_path}", *overrides])
    return cfg, tmp_path / cfg.name


def test_with_the_warm_start_off_every_agent_shape_starts_from_the_base_policy(tmp_path):
    from zerosim.experiment import build_stages, load_experiment

    preset = ROOT / "configs" / "experiments" / "tool-protocol-cpu.yaml"
    cfg = load_experiment(preset, [f"output_dir={tmp_path}", "warmstart=[warmstart.enabled=false]"])
    stages = build_stages(cfg, tmp_path / cfg.name)
    assert not [s for s in stages if s.kind == "warmstart"]
    trains = [s for s in stages if s.kind == "train"]
    assert {s.config.policy.model for s in trains} == {"smollm2"} and all(not s.deps for s in trains)
