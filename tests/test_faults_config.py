"""Fault and bad-input suite, config / data / CLI side (issue 14, items 8 and 9).

Every bad value of every config schema, every malformed data file and every user error out of a command
ends with one line naming the key / file / line and a fix, exit code 2, no traceback, before a model loads;
``ZEROSIM_DEBUG=1`` / ``--debug`` bring the traceback back. The commands run in process (typer's CliRunner)
with the weight loaders patched to fail, so a case that reached a model would fail loudly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from pathlib import Path

import pytest

from simulators.config import SimulatorEvalConfig, SimulatorTrainConfig
from zerosim.core.config import ConfigError, load_config, parse_range

# the schemas a command loads (`zerosim train` / `policy warmstart`, `eval`, `simulator collect|train|eval`)
from zerosim.experiment.config import ExperimentConfig  # noqa: E402
from zerosim.job_config import EvalConfig, SimulatorCollectConfig
from zerosim.training.config import TrainConfig, load_train_config

SCHEMAS = (
    TrainConfig,
    EvalConfig,
    SimulatorCollectConfig,
    SimulatorTrainConfig,
    SimulatorEvalConfig,
    ExperimentConfig,
)

# -- every numeric field has a range --------------------------------------------------------------------------


def _numeric(tp) -> bool:
    if tp in (int, float):
        return True
    if typing.get_origin(tp) is dict:
        return _numeric(typing.get_args(tp)[1])
    return any(_numeric(a) for a in typing.get_args(tp) if a is not type(None))


def _numeric_fields(node, prefix=""):
    """(schema class, field name, dotted key, annotation) of every int / float field under ``node``."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _numeric_fields(value, f"{key}.")
        elif _numeric(hints[f.name]):
            yield type(node), f.name, key, hints[f.name]


def _range(cls, name: str) -> str | None:
    """The range a schema gives its field (``zerosim.core.config.ranged``), or None."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("range")


def _schema_classes(node):
    yield type(node)
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(getattr(node, f.name)):
            yield from _schema_classes(getattr(node, f.name))


def test_every_numeric_field_of_every_schema_has_a_range():
    missing = sorted(
        {
            f"{cls.__module__}.{cls.__name__}.{name}"
            for schema in SCHEMAS
            for cls, name, _, _ in _numeric_fields(schema())
            if _range(cls, name) is None
        }
    )
    assert not missing, f"give these numeric fields a range (zerosim.core.config.ranged): {missing}"
    for schema in SCHEMAS:  # a range only on numbers, and every range parses
        for cls in set(_schema_classes(schema())):
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                if "range" in f.metadata:
                    assert _numeric(hints[f.name]), f"{cls.__name__}.{f.name} has a range but is not a number"
                    parse_range(f.metadata["range"])
    for schema in SCHEMAS:  # the defaults are valid
        load_config(None, schema=schema)


def _bad_values(spec: str, integer: bool):
    valid = parse_range(spec)
    out = []
    if math.isfinite(valid.lo):
        out.append(valid.lo if valid.lo_open else valid.lo - 1)
    if math.isfinite(valid.hi):
        out.append(valid.hi if valid.hi_open else valid.hi + 1)
    out = [int(v) if integer else v for v in out]
    return out if integer else [*out, "nan", "inf", "-inf"]


def _range_cases():
    """One case per numeric field of each schema (the dict-valued reward.weights is tested below)."""
    for schema in SCHEMAS:
        for cls, name, key, hint in _numeric_fields(schema()):
            if "dict" not in str(hint) and "list" not in str(hint):  # each number of those: tested below
                integer = float not in (hint, *typing.get_args(hint))
                yield pytest.param(schema, cls, name, key, integer, id=f"{schema.__name__}:{key}")


# a setting that only means something beside another: the valid value is checked with it
COMPANIONS = {"trainer.collapse_val_drop": ["validation.every=4"]}


@pytest.mark.parametrize("schema, cls, name, key, integer", list(_range_cases()))
def test_every_out_of_range_value_is_refused_with_a_fix_that_works(schema, cls, name, key, integer):
    companions = COMPANIONS.get(key, [])
    for bad in _bad_values(_range(cls, name), integer):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}={bad}"], schema=schema)
        message = str(err.value)
        assert "\n" not in message and f"{key} must be" in message and "got " in message, message
        assert f"set by override '{key}={bad}'" in message, message
        fix = re.search(rf"set e\.g\. {re.escape(key)}=(\S+)", message)
        assert fix, message
        load_config(
            None, [f"{key}={fix.group(1)}", *companions], schema=schema
        )  # the suggested value is valid


def test_reward_weights_are_checked_per_metric():
    with pytest.raises(ConfigError, match=r"reward\.weights\.f1 must be >= 0, got -0\.5"):
        load_train_config(None, ["reward.weights={em: 1.0, f1: -0.5}"])
    with pytest.raises(ConfigError, match=r"reward\.weights\.em must be a finite number"):
        load_train_config(None, ["reward.weights={em: .nan}"])
    with pytest.raises(ConfigError, match="all 0"):
        load_train_config(None, ["reward.weights={em: 0.0}"])


def test_a_bad_value_in_a_recipe_names_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer:\n  max_steps: 0\n")
    with pytest.raises(ConfigError, match=r"trainer\.max_steps must be >= 1, got 0: .*set in .*r\.yaml"):
        load_train_config(recipe)


# -- the CLI: bad input -> exit 2, one line, no traceback, no weights --------------------------------------------


def qa_line(i: int) -> str:
    return json.dumps({"id": f"q{i}", "question": f"Capital of {i}?", "golden_answers": ["Lima"]}) + "\n"


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    good = "".join(qa_line(i) for i in range(4))
    contents = {
        "good.jsonl": good.encode(),
        "bom.jsonl": b"\xef\xbb\xbf" + good.encode(),
        "empty.jsonl": b"",
        "blank.jsonl": b"\n \n",
        "badjson.jsonl": (qa_line(0) + '{"id": "q1", "question": "x?"\n').encode(),
        "badrow.jsonl": (qa_line(0) + qa_line(1) + '{"id": "q2", "question": "x?"}\n').encode(),
        "latin1.jsonl": qa_line(0).encode()
        + '{"id": "q1", "question": "Où?", "golden_answers": ["é"]}\n'.encode("latin-1"),
        # ids 1 and "1": one id once read (the report would score them as one question)
        "dupid.jsonl": (
            qa_line(0)
            + '{"id": 1, "question": "x?", "golden_answers": ["a b"]}\n'
            + '{"id": "1", "question": "y?", "golden_answers": ["c"]}\n'
        ).encode(),
        # answers that normalise to nothing: no prediction could ever match them
        "noanswer.jsonl": (qa_line(0) + '{"id": "q1", "question": "x?", "golden_answers": [""]}\n').encode(),
        "article.jsonl": (
            qa_line(0) + '{"id": "q1", "question": "x?", "golden_answers": ["The", "a"]}\n'
        ).encode(),
        "dup.yaml": b"trainer:\n  max_steps: 3\n  learning_rate: 1e-5\n  max_steps: 4\n",
        "malformed.yaml": b"trainer:\n  max_steps: [3\n  learning_rate: 1e-5\n",
        "tab.yaml": b"trainer:\n\tmax_steps: 3\n",
        "list.yaml": b"- trainer\n",
        "latin1.yaml": "run:\n  name: café\n".encode("latin-1"),
        "prompts.yaml": b"useful: [unclosed\n",
    }
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    return {name: tmp_path / name for name in contents}


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Run ``zerosim ARGS`` in process in ``tmp_path``; any weight load fails the test."""
    import transformers
    from typer.testing import CliRunner

    import zerosim.core.models
    from zerosim.cli import app

    loads = []

    def no_weights(*args, **kwargs):
        loads.append(args)
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(zerosim.core.models, "load_causal_lm", no_weights)
    monkeypatch.setattr(zerosim.core.models, "load_tokenizer", no_weights)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
    monkeypatch.delenv("ZEROSIM_DEBUG", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)

    def run(*args, env=None):
        result = CliRunner().invoke(app, [str(a) for a in args], env=env)
        assert not loads, "a model was loaded"
        return result

    return run


def _fails_cleanly(result, *words):
    output = result.output
    assert result.exit_code == 2, (result.exit_code, output, result.exception)
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output  # one line
    for word in words:
        assert word in output, (word, output)


# (id, command line ({name} = a file of the fixture), words the message must hold)
TRAIN_DRY_RUN = [
    # an MLflow store that cannot be written: refused before the policy loads, not ~2 minutes in
    ("mlflow-store-folder-missing", ["tracking.tracking_uri=sqlite:////nonexistent/dir/m.db"], ["tracking.tracking_uri", "folder /nonexistent/dir does not exist"]),
    ("mlflow-store-is-a-folder", ["tracking.tracking_uri=sqlite:////tmp"], ["tracking.tracking_uri", "is a folder"]),
    # tried for real: root passes os.access everywhere, /proc too; a dead server answers nothing
    ("mlflow-store-folder-unwritable", ["tracking.tracking_uri=sqlite:////proc/mlflow.db"], ["tracking.tracking_uri=sqlite:////proc/mlflow.db", "/proc is not writable"]),
    ("mlflow-store-not-a-database", ["tracking.tracking_uri=sqlite:///{good.jsonl}"], ["tracking.tracking_uri", "good.jsonl is not an sqlite database"]),
    ("mlflow-server-dead", ["tracking.tracking_uri=http://127.0.0.1:9"], ["tracking.tracking_uri=http://127.0.0.1:9", "no answer within 5s"]),
    # factbook:SPLIT is the embedded split, as eval reads it: a second split, or one it has not, is refused
    ("factbook-split-conflict", ["data.train=factbook:fact-train", "data.split=dev"], ["data.train=factbook:fact-train names split fact-train", "data.split=dev"]),
    ("factbook-split-unknown", ["data.train=factbook:fact-trian"], ["data.train=factbook:fact-trian", "splits train, dev, test", "'fact-trian'"]),
    ("warmstart-factbook-split-conflict", ["warmstart.enabled=true", "warmstart.data=factbook:dev", "warmstart.split=test"], ["warmstart.data=factbook:dev", "warmstart.split=test"]),
    ("validation-factbook-split-conflict", ["validation.every=2", "validation.data=factbook:fact-test", "validation.split=test"], ["validation.data=factbook:fact-test", "validation.split=test"]),
    # item 8: values that used to pass --dry-run and die after the models loaded
    ("batch-size-0", ["trainer.per_device_train_batch_size=0"], ["trainer.per_device_train_batch_size", ">= 1", "got 0"]),
    ("learning-rate-negative", ["trainer.learning_rate=-1"], ["trainer.learning_rate must be > 0", "-1"]),
    ("max-steps-0", ["trainer.max_steps=0"], ["trainer.max_steps must be >= 1"]),
    ("max-examples-negative", ["data.max_examples=-5"], ["data.max_examples must be >= 1", "-5"]),
    ("http-retries-0", ["search.engine=http", "search.http.retries=0"], ["search.http.retries must be >= 1"]),
    ("http-read-timeout-negative", ["search.http.read_timeout=-1"], ["search.http.read_timeout must be > 0"]),
    ("http-connect-timeout-0", ["search.http.connect_timeout=0"], ["search.http.connect_timeout must be > 0"]),
    ("simulator-retries-0", ["search.simulator.retries=0"], ["search.simulator.retries must be >= 1"]),
    ("simulator-read-timeout-negative", ["search.simulator.read_timeout=-1"], ["search.simulator.read_timeout"]),
    ("rollout-temperature-nan", ["rollout.temperature=nan"], ["rollout.temperature must be a finite number", "nan"]),
    ("rollout-temperature-inf", ["rollout.temperature=inf"], ["rollout.temperature", "inf"]),
    ("simulator-temperature-nan", ["search.simulator.temperature=nan"], ["search.simulator.temperature", "nan"]),
    ("simulator-top-p-0", ["search.simulator.top_p=0"], ["search.simulator.top_p must be in (0, 1]"]),
    ("warmstart-simulator-inf", ["warmstart.search.simulator.temperature=inf"], ["warmstart.search.simulator.temperature"]),
    ("validation-batch-size-0", ["validation.batch_size=0"], ["validation.batch_size must be >= 1"]),
    ("warmstart-lr-nan", ["warmstart.learning_rate=nan"], ["warmstart.learning_rate"]),
    ("gamma-above-1", ["trainer.gamma=1.5"], ["trainer.gamma must be in [0, 1]"]),
    ("sample-every-0", ["tracking.sample_every=0"], ["tracking.sample_every must be >= 1"]),
    ("seed-negative", ["run.seed=-1"], ["run.seed must be >= 0"]),
    ("save-total-limit-0", ["trainer.save_total_limit=0"], ["trainer.save_total_limit must be >= 1"]),
    ("adaptive-thresholds-crossed", ["curriculum.schedule=adaptive", "curriculum.adaptive_lower_below=0.9"], ["adaptive_lower_below", "below"]),
    # item 8: data files read at --dry-run (file and line named)
    ("data-invalid-json", ["data.train={badjson.jsonl}"], ["data.train", "badjson.jsonl line 2", "invalid JSON"]),
    ("data-malformed-row", ["data.train={badrow.jsonl}"], ["badrow.jsonl line 3", "golden_answers"]),
    ("data-empty", ["data.train={empty.jsonl}"], ["data.train", "empty.jsonl", "no questions"]),
    ("data-blank-lines", ["data.train={blank.jsonl}"], ["blank.jsonl", "no questions"]),
    ("data-not-utf8", ["data.train={latin1.jsonl}"], ["latin1.jsonl line 2", "not UTF-8"]),
    ("validation-data-malformed", ["data.train={good.jsonl}", "validation.every=2", "validation.data={badrow.jsonl}"], ["validation.data", "badrow.jsonl line 3"]),
    ("warmstart-data-malformed", ["data.train={good.jsonl}", "warmstart.enabled=true", "warmstart.data={latin1.jsonl}"], ["warmstart.data", "latin1.jsonl line 2"]),
    ("prompts-file-malformed", ["data.train={good.jsonl}", "search.simulator.prompts_file={prompts.yaml}"], ["prompts.yaml"]),
    ("data-repeated-id", ["data.train={dupid.jsonl}"], ["data.train", "dupid.jsonl line 3", "question id '1' repeats the id of line 2"]),
    ("data-answer-empty", ["data.train={noanswer.jsonl}"], ["noanswer.jsonl line 2", "'golden_answers'", "normalisation"]),
    ("data-answers-only-articles", ["data.train={article.jsonl}"], ["article.jsonl line 2", "['The', 'a']", "normalisation"]),
    ("validation-data-repeated-id", ["data.train={good.jsonl}", "validation.every=2", "validation.data={dupid.jsonl}"], ["validation.data", "dupid.jsonl line 3"]),
    ("factbook-unknown-split", ["data.split=validation"], ["data.train", "splits train, dev, test", "'validation'"]),
    ("bm25-corpus-missing", ["data.train={good.jsonl}", "search.engine=bm25", "search.bm25.corpus=nope.jsonl"], ["search.bm25.corpus", "nope.jsonl"]),
    ("noise-without-negatives", ["data.train={good.jsonl}", "search.engine=bm25", "search.negatives=none"], ["search.negatives=none", "curriculum.p_end=0"]),
    # a reranker the build could not load offline (HF_HUB_OFFLINE=1): refused before the policy loads
    ("reranker-hub-id-not-cached", ["data.train={good.jsonl}", "search.engine=bm25", "search.rerank.model=cross-encoder/zerosim-never-cached"], ["search.rerank.model", "not in the Hugging Face cache", "search.rerank.model=null"]),
    ("reranker-relative-path-missing", ["data.train={good.jsonl}", "search.engine=bm25", "search.rerank.model=models/reranker"], ["search.rerank.model", "models/reranker is no local folder"]),
    # tracking.log_model logs the final checkpoint: without one it used to be dropped silently
    ("log-model-without-final-checkpoint", ["tracking.log_model=true", "trainer.save_final=false"], ["tracking.log_model=true", "set trainer.save_final=true"]),
    # item 9: YAML that used to end in a traceback
    ("yaml-duplicate-key", ["--config", "{dup.yaml}"], ["dup.yaml line 4", "duplicate key 'max_steps'"]),
    ("yaml-malformed", ["--config", "{malformed.yaml}"], ["malformed.yaml line 3", "malformed YAML"]),
    ("yaml-tab", ["--config", "{tab.yaml}"], ["tab.yaml line 2", "malformed YAML"]),
    ("yaml-not-utf8", ["--config", "{latin1.yaml}"], ["latin1.yaml line 2", "not UTF-8"]),
    ("override-unparsable", ["trainer.max_steps=[3"], ["override 'trainer.max_steps=[3'", "cannot parse"]),
    ("wrong-type-one-line", ["trainer.max_steps=many"], ["wrong type for config key 'trainer.max_steps'"]),
    # already worked: stay working
    ("unknown-key (already worked)", ["trainer.learning_rat=0.1"], ["unknown config key 'trainer.learning_rat'", "learning_rate"]),
    ("bad-choice (already worked)", ["search.engine=google"], ["search.engine", "valid values"]),
    ("group-of-one (already worked)", ["trainer.num_generations=1"], ["trainer.num_generations must be >= 2"]),
    ("not-a-multiple (already worked)", ["trainer.per_device_train_batch_size=6"], ["multiple of", "=8"]),
    ("missing-config-file (already worked)", ["--config", "nope.yaml"], ["nope.yaml does not exist"]),
    ("yaml-list (already worked)", ["--config", "{list.yaml}"], ["YAML mapping"]),
    ("no-equals (already worked)", ["trainer.max_steps"], ["key=value"]),
    ("missing-data-file (already worked)", ["data.train=nope.jsonl"], ["nope.jsonl", "does not exist"]),
    # where the job writes: a file there failed at the first save, after the models loaded
    ("output-dir-is-a-file", ["run.output_dir={good.jsonl}"], ["run.output_dir", "good.jsonl is an existing file, not a folder"]),
]  # fmt: skip


def _fill(args, files):
    return [re.sub(r"\{([\w.]+)\}", lambda m: str(files[m.group(1)]), a) for a in args]


@pytest.mark.parametrize("args, words", [c[1:] for c in TRAIN_DRY_RUN], ids=[c[0] for c in TRAIN_DRY_RUN])
def test_train_dry_run_refuses_bad_input(cli, files, tmp_path, monkeypatch, args, words):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as the suite runs (conftest): the hub cannot be reached
    result = cli("train", "--dry-run", *_fill(args, files))
    _fails_cleanly(result, *words)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()


OTHER_COMMANDS = [
    # a job that trains nothing has no model to log: the setting was dropped in silence
    ("simulator-eval-log-model", ["simulator", "eval", "tracking.log_model=true"], ["tracking.log_model=true", "a simulator evaluation trains no model"]),
    ("eval-limit-0", ["eval", "--limit", "0"], ["limit must be >= 1", "got 0"]),
    ("eval-limit-negative", ["eval", "--limit", "-1"], ["limit must be >= 1"]),
    ("eval-batch-size-0", ["eval", "batch_size=0"], ["batch_size must be >= 1"]),
    ("eval-temperature-nan", ["eval", "rollout.temperature=nan"], ["rollout.temperature", "nan"]),
    ("eval-http-retries-0", ["eval", "--search", "http", "search.http.retries=0"], ["search.http.retries"]),
    ("eval-duplicate-key", ["eval", "--config", "{dup.yaml}"], ["dup.yaml line 4", "duplicate key"]),
    ("simulator-eval-temperature-nan", ["simulator", "eval", "simulator.temperature=nan"], ["simulator.temperature", "nan"]),
    ("simulator-eval-k-0", ["simulator", "eval", "k=0"], ["k must be >= 1"]),
    ("simulator-collect-max-questions-0", ["simulator", "collect", "--max-questions", "0"], ["max_questions must be >= 1"]),
    ("simulator-train-lora-dropout-1", ["simulator", "train", "lora_dropout=1"], ["lora_dropout must be in [0, 1)"]),
    ("simulator-train-max-steps-0", ["simulator", "train", "--max-steps", "0"], ["max_steps must be >= 1"]),
    ("warmstart-batch-size-0", ["policy", "warmstart", "warmstart.batch_size=0"], ["warmstart.batch_size must be >= 1"]),
]  # fmt: skip


@pytest.mark.parametrize("args, words", [c[1:] for c in OTHER_COMMANDS], ids=[c[0] for c in OTHER_COMMANDS])
def test_other_commands_refuse_bad_values(cli, files, args, words):
    _fails_cleanly(cli(*_fill(args, files)), *words)


ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "experiments" / "sim-vs-real-smoke.yaml"
# an experiment's inputs that only a later stage reads: refused by --dry-run and before the first stage
EXPERIMENT_INPUTS = [
    ("eval-file-missing", ["eval.datasets=[flash/missing.jsonl]"], ["eval.datasets", "flash/missing.jsonl does not exist"]),
    # held-out files read with eval's row checks; an empty list refused (it stopped the run after the warm start)
    ("eval-datasets-empty", ["eval.datasets=[]"], ["eval.datasets is empty"]),
    ("eval-file-repeated-id", ["eval.datasets=[{dupid.jsonl}]"], ["eval.datasets", "dupid.jsonl line 3", "question id '1' repeats the id of line 2"]),
    ("eval-file-malformed-row", ["eval.datasets=[{badrow.jsonl}]"], ["eval.datasets", "badrow.jsonl line 3", "golden_answers"]),
    ("eval-file-no-rows", ["eval.datasets=[{blank.jsonl}]"], ["blank.jsonl", "no rows to evaluate"]),
    ("eval-split-unknown", ["eval.split=validation"], ["eval.datasets", "splits train, dev, test", "'validation'"]),
    ("simulator-path-missing", ["simulator.model=./sims/none"], ["simulator.model", "./sims/none does not exist"]),
    ("resamples-0", ["report.resamples=0"], ["report.resamples must be >= 100", "got 0"]),
    ("resamples-1", ["report.resamples=1"], ["report.resamples must be >= 100"]),
    ("seeds-twice", ["seeds=[0,0]"], ["seeds lists 0 more than once"]),
    ("report-pair-unknown-arm", ["report.pairs=[sim:warm]"], ["report.pairs entry 'sim:warm'", "ARM:AGAINST"]),
    ("report-pair-not-a-pair", ["report.pairs=[sim]"], ["report.pairs entry 'sim'", "two different enabled arms"]),
    ("seed-negative", ["seeds=[0,-1]"], ["seeds[1] must be >= 0"]),
    ("mlflow-store-folder-missing", ["tracking.tracking_uri=sqlite:////nonexistent/dir/m.db"], ["tracking.tracking_uri", "does not exist"]),
    ("mlflow-store-folder-unwritable", ["tracking.tracking_uri=sqlite:////proc/mlflow.db"], ["tracking.tracking_uri", "/proc is not writable"]),
    ("mlflow-server-dead", ["tracking.tracking_uri=http://127.0.0.1:9"], ["tracking.tracking_uri=http://127.0.0.1:9", "no answer"]),
    ("arm-factbook-split-conflict", ["arms.real.overrides=[search.engine=bm25,data.train=factbook:fact-train,data.split=dev]"], ["data.train=factbook:fact-train names split fact-train", "data.split=dev"]),
    # an arm's name is its report row and its folders: a baseline's row name merged the two into one row
    ("arm-named-like-rag-baseline", ["arms.base-rag.rl=false"], ["arms.base-rag", "rag baseline", "rename the arm"]),
    ("arm-named-like-direct-baseline", ["arms.base-direct.overrides=[search.engine=bm25]"], ["arms.base-direct", "direct baseline"]),
    ("arm-name-with-a-slash", ["arms.a/b.rl=false"], ["arms.'a/b'", "^[a-z0-9][a-z0-9._-]*$", "arms.a-b"]),
    ("arm-name-uppercase", ["arms.Real2.rl=false"], ["arms.'Real2'", "rename the arm, e.g. arms.real2"]),
    ("arm-name-empty", ['arms={"": {rl: false}}'], ["arms.''", "^[a-z0-9][a-z0-9._-]*$"]),
    # its run folder would be a model folder: left out of its results and exports
    ("arm-named-like-a-model-folder", ["arms.best.rl=false"], ["arms.best", "model folder", "arms.arm-best"]),
    ("arm-named-like-a-checkpoint", ["arms.checkpoint-9.rl=false"], ["arms.checkpoint-9", "model folder"]),
    ("output-dir-is-a-file", ["output_dir=a-file"], ["output_dir", "a-file is an existing file, not a folder"]),
    ("log-model-without-final-checkpoint", ["tracking.log_model=true", "overrides=[trainer.save_final=false]"], ["arms.", "tracking.log_model=true", "trainer.save_final=false"]),
    # inputs only a training or evaluation stage reads, hours in: read as that stage's job reads them, first
    ("launcher-not-a-program", ["train_launcher=acelerate launch --num_processes 2"], ["train_launcher", "'acelerate' is not a program on PATH"]),
    ("arm-training-file-missing", ["arms.real.overrides=[search.engine=bm25,data.train=qa/typo.jsonl]"], ["data.train", "qa/typo.jsonl does not exist"]),
    ("arm-corpus-missing", ["arms.real.overrides=[search.engine=bm25,search.bm25.corpus=corp/typo.jsonl]"], ["train-real-s0: search.bm25.corpus", "corp/typo.jsonl does not exist"]),
    # an eval stage searches and rolls out as the base recipe does: an override of those would be dropped
    ("eval-override-replaced", ["eval.overrides=[search.bm25.corpus=corp/typo.jsonl]"], ["eval.overrides: search.bm25.corpus=corp/typo.jsonl would be replaced", "overrides="]),
    ("recipe-corpus-missing", ["overrides=[search.bm25.corpus=corp/typo.jsonl]"], ["search.bm25.corpus", "corp/typo.jsonl does not exist"]),
    ("warmstart-file-missing", ["warmstart=[warmstart.data=ws/typo.jsonl]"], ["warmstart.data", "ws/typo.jsonl does not exist"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "args, words", [c[1:] for c in EXPERIMENT_INPUTS], ids=[c[0] for c in EXPERIMENT_INPUTS]
)
def test_experiment_refuses_what_a_later_stage_would_read(cli, files, tmp_path, args, words):
    """The dry run prints its plan and lists it under the plan (exit 2, issue 36: a user reads the plan before
    fetching what is missing); a real run refuses it before its first stage (nothing written)."""
    from zerosim.experiment import load_experiment, run_experiment

    args = _fill(args, files)
    base = [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", f"output_dir={tmp_path / 'exp'}"]
    (tmp_path / "a-file").write_text("not a folder\n")  # the cli fixture runs in tmp_path
    result = cli("experiment", "--config", SMOKE, "--dry-run", *base, *args)
    if result.output.startswith("error: "):  # a setting refused as the config loads: one line
        _fails_cleanly(result, *words)
    else:  # an input a stage reads: listed under the plan
        assert result.exit_code == 2 and "Traceback" not in result.output, (result.output, result.exception)
        plan, _, listed = result.output.partition("missing inputs (")
        assert "report" in plan and listed, result.output  # the plan first, then what is missing
        assert all(word in listed for word in words), (words, listed)
    with pytest.raises(Exception) as err:
        run_experiment(load_experiment(SMOKE, [*base, *args]), echo=lambda line: None)
    assert all(word in str(err.value) for word in words), str(err.value)
    assert not (tmp_path / "exp").exists()


def test_factbook_split_is_the_embedded_split_in_every_dataset_setting(cli):
    """``factbook:SPLIT`` in data.train, warmstart.data and validation.data reads the embedded split, as
    ``zerosim eval --dataset factbook:SPLIT`` does (it was a hub dataset id, failing 15 s into the run); the
    split settings at their defaults give way to it, and the run reads what the dry run shows."""
    from zerosim.training.config import load_train_config

    args = [
        "data.train=factbook:fact-train",
        "warmstart.enabled=true",
        "warmstart.data=factbook:fact-tune",
        "validation.every=2",
        "validation.data=factbook:fact-test",
    ]
    result = cli("train", "--dry-run", *args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "factbook fact-train (" in result.output and "embedded" in result.output, result.output
    assert "Hugging Face" not in result.output, result.output
    assert "factbook fact-tune (" in result.output and "factbook fact-test (" in result.output, result.output
    cfg = load_train_config(None, [*args, "data.split=fact-train"])  # the same split given twice: one split
    assert (cfg.data.train, cfg.data.split) == ("factbook", "fact-train")
    assert (cfg.warmstart.data, cfg.warmstart.split) == ("factbook", "fact-tune")
    assert (cfg.validation.data, cfg.validation.split) == ("factbook", "fact-test")
    # the simulator jobs name their questions the same way
    from simulators.config import SimulatorEvalConfig
    from zerosim.core.config import ConfigError, load_config
    from zerosim.job_config import SimulatorCollectConfig

    sim = load_config(None, ["data=factbook:fact-test"], schema=SimulatorEvalConfig)
    assert (sim.data, sim.split) == ("factbook", "fact-test")
    with pytest.raises(ConfigError, match="data=factbook:fact-train names split fact-train, and split=dev"):
        load_config(None, ["data=factbook:fact-train", "split=dev"], schema=SimulatorCollectConfig)


def test_dry_run_reads_every_data_file_and_loads_no_weights(cli, files, tmp_path):
    result = cli(
        "train", "--dry-run", f"data.train={files['good.jsonl']}", "data.max_examples=2",
        "validation.every=2", f"validation.data={files['bom.jsonl']}",
        "warmstart.enabled=true", f"warmstart.data={files['good.jsonl']}",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "dry run: nothing loaded" in result.output
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()
    from zerosim.training.dry_run import plan

    rows = dict(plan(load_train_config(None, [
        f"data.train={files['good.jsonl']}", "data.max_examples=2", "validation.every=2",
        f"validation.data={files['bom.jsonl']}", "warmstart.enabled=true", f"warmstart.data={files['good.jsonl']}",
    ])))  # fmt: skip
    assert rows["data"].endswith("good.jsonl (4 questions, 2 drawn (seeded), every row checked)")
    assert "bom.jsonl (4 questions, every row checked)" in rows["validation"]  # a UTF-8 BOM is fine
    assert "trajectories from " in rows["warm start"] and "good.jsonl (4 questions" in rows["warm start"]


def test_non_utf8_data_names_file_and_line_in_normal_loading(files):
    from zerosim.core.data import DataError, load_qa

    with pytest.raises(DataError, match=r"latin1\.jsonl line 2: not UTF-8 text \(byte 0xf9"):
        load_qa(files["latin1.jsonl"])
    assert len(load_qa(files["bom.jsonl"])) == 4


def _flashrag(qid, answers):
    return {"id": qid, "question": "Capital of Peru?", "golden_answers": answers}


def _search_r1(index, answers, source="nq"):
    """A Search-R1 training row (no 'id': extra_info.index is its id)."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": "Answer it. Question: Capital of Peru?\n"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": answers}},
        "extra_info": {"split": "train", "index": index},
    }


# (id, file suffix, rows, words the DataError must hold): every QA loader applies one row check (an answer
# that survives normalisation) and one data-set check (unique ids, compared as text)
QA_LOADER_FAULTS = [
    ("jsonl-answer-empty", ".jsonl", [_flashrag("a", ["Lima"]), _flashrag("b", [""])], ["line 2", "'golden_answers'", "normalisation"]),
    ("jsonl-answer-article", ".jsonl", [_flashrag("a", ["the"])], ["line 1", "['the']", "give the row a real answer"]),
    ("jsonl-answer-punctuation", ".jsonl", [_flashrag("a", ["?", " "])], ["line 1", "normalisation"]),
    ("parquet-answer-article", ".parquet", [_flashrag("a", ["Lima"]), _flashrag("b", ["An"])], ["row 2", "'golden_answers'"]),
    ("search-r1-target-article", ".parquet", [_search_r1(0, ["Lima"]), _search_r1(1, ["the"])], ["row 2", "'reward_model.ground_truth.target'", "normalisation"]),
    ("search-r1-target-empty (already refused)", ".parquet", [_search_r1(0, [""])], ["row 1", "'reward_model.ground_truth.target'"]),
    ("jsonl-id-int-and-str", ".jsonl", [_flashrag(1, ["Lima"]), _flashrag("x", ["Oslo"]), _flashrag("1", ["Rome"])], ["line 3: question id '1' repeats the id of line 1", '1 and "1" are one id']),
    ("jsonl-ids-repeated-twice", ".jsonl", [_flashrag("a", ["Lima"]), _flashrag("a", ["Oslo"]), _flashrag("a", ["Rome"])], ["line 2", "(1 more repeated id(s) after it)"]),
    ("parquet-id-repeated", ".parquet", [_flashrag("q7", ["Lima"]), _flashrag("q7", ["Oslo"])], ["row 2: question id 'q7' repeats the id of row 1"]),
    ("search-r1-repeated-in-one-source", ".parquet", [_search_r1(0, ["Lima"], "nq"), _search_r1(1, ["Oslo"], "hq"), _search_r1(0, ["Rome"], "nq")], ["row 3: question id '0' repeats the id of row 1"]),
]  # fmt: skip


@pytest.mark.parametrize(
    "suffix, rows, words", [c[1:] for c in QA_LOADER_FAULTS], ids=[c[0] for c in QA_LOADER_FAULTS]
)
def test_qa_loaders_refuse_unscorable_answers_and_repeated_ids(tmp_path, suffix, rows, words):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zerosim.core.data import DataError, load_qa

    path = tmp_path / f"qa{suffix}"
    if suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError) as err:
        load_qa(path)
    message = str(err.value)
    assert message.startswith(f"{path} ") and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_a_file_merging_data_sets_keeps_each_question_apart_by_its_source(tmp_path):
    """Search-R1's merged training file (nq + hotpotqa) keeps each set's own ids, so ``0`` is in both: the ids
    are qualified by ``data_source`` (``nq/0``, ``hotpotqa/0``) rather than the file refused or two questions
    merged."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zerosim.core.data import load_qa

    path = tmp_path / "nq_hotpotqa_train.parquet"
    rows = [_search_r1(0, ["Lima"]), _search_r1(1, ["Quito"]), _search_r1(0, ["Oslo"], source="hotpotqa")]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [(ex.id, ex.golden_answers) for ex in load_qa(path)] == [
        ("nq/0", ("Lima",)),
        ("nq/1", ("Quito",)),
        ("hotpotqa/0", ("Oslo",)),
    ]


def test_qa_loaders_keep_a_row_with_one_scorable_answer(tmp_path):
    """Only a row with no answer left after normalisation is refused: one real answer among empty ones counts."""
    from zerosim.core.data import load_qa

    path = tmp_path / "qa.jsonl"
    path.write_text(
        json.dumps(_flashrag(1, ["the", "", "Lima"])) + "\n" + json.dumps(_flashrag(2, ["a b"])) + "\n"
    )
    assert [(ex.id, ex.golden_answers) for ex in load_qa(path)] == [
        ("1", ("the", "", "Lima")),
        ("2", ("a b",)),
    ]


def test_a_reranker_is_refused_offline_only_when_the_cache_lacks_it(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE's rule: a hub id loads offline from the cache, so only an id it lacks is refused; online
    any well-formed id may be fetched at start."""
    from huggingface_hub import constants

    from zerosim.engines import rerank_source

    snapshot = tmp_path / "hub" / "models--org--reranker" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--reranker" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--reranker" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert rerank_source("org/reranker") == "Hugging Face id"
    with pytest.raises(ConfigError, match="org/other is no local folder and not in the Hugging Face cache"):
        rerank_source("org/other")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert rerank_source("org/other") == "Hugging Face id"


def test_experiment_log_model_reaches_every_arm_and_changes_no_stage_key(tmp_path):
    """The experiment's own tracking.log_model=true is given to each arm's training job (its final policy is
    logged); where runs are logged is no part of a key, so finished stages are reused as they were."""
    from zerosim.experiment import build_stages, load_experiment

    base = [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", f"output_dir={tmp_path}"]
    stages = {}
    for log in ("false", "true"):
        cfg = load_experiment(SMOKE, [*base, f"tracking.log_model={log}"])
        stages[log] = build_stages(cfg, cfg.root)
    assert [s.key for s in stages["true"]] == [s.key for s in stages["false"]]
    trains = [s for s in stages["true"] if s.kind == "train"]
    assert trains and all(s.config.tracking.log_model for s in trains)
    (warm,) = [s for s in stages["true"] if s.kind == "warmstart"]  # the shared warm start's policy too
    assert warm.config.tracking.log_model
    assert not any(s.config.tracking.log_model for s in stages["false"] if s.kind == "train")
    evals = [s for s in stages["true"] if s.kind == "eval"]
    assert evals and not any(s.config.tracking.log_model for s in evals)  # an eval has no model to log


# -- errors out of the commands: one line, exit 2; the traceback on request ------------------------------------


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


def _error(name: str, message: str):
    from zerosim.core.config import ConfigError
    from zerosim.core.data import DataError
    from zerosim.core.models import ModelError
    from zerosim.core.search import SearchError

    kinds = {"ConfigError": ConfigError, "DataError": DataError, "SearchError": SearchError,
             "ModelError": ModelError, "FileExistsError": FileExistsError,
             "FileNotFoundError": FileNotFoundError}  # fmt: skip
    return kinds[name](message)


# (id, module, function the command calls, error class, command line)
RAISED = [
    ("train-SearchError", "zerosim.training.recipe", "train", "SearchError", ["train"]),
    ("train-FileExistsError", "zerosim.training.recipe", "train", "FileExistsError", ["train"]),
    ("train-ConfigError", "zerosim.training.recipe", "train", "ConfigError", ["train"]),
    ("train-DataError", "zerosim.training.recipe", "train", "DataError", ["train"]),
    ("eval-SearchError", "eval.run", "run_eval", "SearchError", ["eval"]),
    ("eval-FileExistsError", "eval.run", "run_eval", "FileExistsError", ["eval"]),
    ("index-build-FileExistsError", "eval.index", "build_index", "FileExistsError", ["index", "build", "--corpus", "factbook", "--kind", "bm25", "--out", "idx"]),
    ("index-build-DataError", "eval.index", "build_index", "DataError", ["index", "build", "--corpus", "factbook", "--kind", "bm25", "--out", "idx"]),
    ("serve-SearchError", "eval.index", "load_index", "SearchError", ["serve", "retriever", "--index", "idx"]),
    ("simulator-serve-FileNotFoundError", "simulators.openai_server", "start_simulator_server", "FileNotFoundError", ["simulator", "serve"]),
    ("simulator-train-FileExistsError", "simulators.sft", "run_sft", "FileExistsError", ["simulator", "train"]),
    ("warmstart-DataError", "zerosim.training.warmstart", "run_warmstart", "DataError", ["policy", "warmstart"]),
]  # fmt: skip


@pytest.mark.parametrize("module, function, kind, args", [c[1:] for c in RAISED], ids=[c[0] for c in RAISED])
def test_user_errors_out_of_a_command_are_one_line(cli, monkeypatch, module, function, kind, args):
    import importlib

    message = f"a {kind} the user can fix: do this instead"
    monkeypatch.setattr(importlib.import_module(module), function, _raise(_error(kind, message)))
    _fails_cleanly(cli(*args), message)


def test_debug_shows_the_traceback(cli, files, monkeypatch):
    import zerosim.training.recipe

    monkeypatch.setattr(
        zerosim.training.recipe, "train", _raise(FileExistsError("outputs/x holds another run"))
    )
    for result in (
        cli("train", env={"ZEROSIM_DEBUG": "1"}),
        cli("train", "--debug"),
        cli("--debug", "train"),
    ):
        assert result.exit_code == 2, result.output
        assert (
            "Traceback" in result.output and "FileExistsError: outputs/x holds another run" in result.output
        )
        assert (
            result.output.rstrip().splitlines()[-1] == "error: FileExistsError: outputs/x holds another run"
        )
    result = cli("train", "--dry-run", "--config", str(files["dup.yaml"]), env={"ZEROSIM_DEBUG": "1"})
    assert result.exit_code == 2 and "Traceback" in result.output and "duplicate key" in result.output


def test_os_errors_and_library_errors_read_as_one_line(cli, monkeypatch):
    import eval.run

    monkeypatch.setattr(
        eval.run, "run_eval", _raise(FileNotFoundError(2, "No such file or directory", "/x/y"))
    )
    _fails_cleanly(cli("eval"), "/x/y: No such file or directory")
    # not raised by zerosim (maybe a bug): the traceback, then the one line, exit code 2
    monkeypatch.setattr(eval.run, "run_eval", _raise(json.JSONDecodeError("Expecting value", "x", 0)))
    result = cli("eval")
    assert result.exit_code == 2 and "Traceback" in result.output, result.output
    assert (
        result.output.strip().splitlines()[-1]
        == "error: JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    )


def test_a_bug_still_shows_its_traceback(cli, monkeypatch):
    import eval.run

    monkeypatch.setattr(eval.run, "run_eval", _raise(RuntimeError("a bug")))
    result = cli("eval")
    assert result.exit_code != 2 and isinstance(result.exception, RuntimeError)  # not hidden as a user error


def test_eval_config_message_names_the_flag_override():
    with pytest.raises(ConfigError, match=r"limit must be >= 1 \(null = every row\), got 0"):
        load_config(None, ["limit=0"], schema=EvalConfig)
    assert load_config(None, ["limit=null"], schema=EvalConfig).limit is None
    assert isinstance(load_train_config(None, []), TrainConfig)


REAL_TRAIN = [
    "data-malformed-row",
    "validation-data-malformed",
    "prompts-file-malformed",
    "bm25-corpus-missing",
    "output-dir-is-a-file",
]


@pytest.mark.parametrize("case", REAL_TRAIN)
def test_a_real_train_refuses_what_dry_run_refuses_before_weights_load(cli, files, case):
    """`zerosim train` (no --dry-run) runs the dry run's checks first: a bad data file stops the job before
    any weight loads (here: validation.data, read only after the policy loaded before)."""
    args, words = next((a, w) for name, a, w in TRAIN_DRY_RUN if name == case)
    _fails_cleanly(cli("train", *_fill(args, files)), *words)


def test_dry_run_refuses_a_fresh_run_over_another_runs_checkpoints(cli, files, tmp_path):
    import torch

    checkpoint = tmp_path / "outputs" / "zerosim" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    torch.save(
        {"global_step": 2, "files": {}}, checkpoint / "zerosim_state.pt"
    )  # complete: a resume could use it
    _fails_cleanly(
        cli("train", "--dry-run", f"data.train={files['good.jsonl']}"),
        "checkpoint-2",
        "resume=true",
        "run.name",
    )


def test_noise_check_without_an_engine_leaves_http_to_the_server():
    """Over http, negatives=none hands noisy slots to the engine behind the server (a simulator writes them):
    only /health can tell, at start-up. A local retriever with negatives=none can never fill them."""
    from zerosim.engines import check_noise_config

    http = load_train_config(None, ["search.engine=http", "search.negatives=none"])
    check_noise_config(http.search, http.curriculum)
    bm25 = load_train_config(None, ["search.engine=bm25", "search.negatives=none"])
    with pytest.raises(ConfigError, match="search.negatives=none leaves the bm25 retriever's noisy slots"):
        check_noise_config(bm25.search, bm25.curriculum)


# -- issue 50: crashes and dead ends, refused in one line before any work -------------------------------------


@pytest.mark.parametrize("gb", ["inf", "nan", "1e30", "0", "-80"])
def test_gpu_memory_outside_any_card_is_refused_naming_the_option(cli, gb):
    """--gpu-memory inf ended in "cannot convert float NaN to integer" (vllm_colocate's share of the card), 1e30
    planned a card of 1e30 GB, 0 / nan got typer's usage box: one line naming the option and its range."""
    result = cli("train", "--dry-run", "--gpu-memory", gb, "trainer.generation=vllm_colocate")
    _fails_cleanly(result, f"--gpu-memory {float(gb):g}", "from 1 to 4096", "a few hundred GB")


def _dead_url() -> str:
    """A local port nothing listens on (a connection is refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_dead_vllm_server_is_refused_also_in_a_plan_for_another_card(cli, monkeypatch):
    """Under --gpu-memory (a plan for another machine's GPU) the server was not asked: a dead URL passed the dry
    run. It is asked from here, with the health probe's short timeout."""
    import time

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    url = _dead_url()
    started = time.perf_counter()
    result = cli(
        "train", "--dry-run", "--gpu-memory", "80", "trainer.generation=vllm_server",
        f"trainer.vllm_server_url={url}",
    )  # fmt: skip
    _fails_cleanly(result, f"trainer.vllm_server_url {url}", "/health", "--gpu-memory")
    assert time.perf_counter() - started < 30


def _experiment(cli, tmp_path, *args):
    from zerosim.experiment import load_experiment, run_experiment

    base = [f"base={ROOT / 'configs' / 'demo-learning.yaml'}", f"output_dir={tmp_path / 'exp'}"]
    dry = cli("experiment", "--config", SMOKE, "--dry-run", *base, *args)
    with pytest.raises(ConfigError) as err:  # the real run: before its first stage, nothing written
        run_experiment(load_experiment(SMOKE, [*base, *args]), echo=lambda line: None)
    assert not (tmp_path / "exp").exists()
    return dry, str(err.value)


def test_an_eval_override_split_the_dataset_lacks_is_refused_by_the_dry_run(cli, tmp_path):
    """eval.overrides=[split=nosuch] passed the dry run (it checked eval.split) and the run stopped 31 s in,
    at the first evaluation: each eval stage's split is checked as the stage applies it."""
    dry, error = _experiment(cli, tmp_path, "eval.overrides=[split=nosuch]")
    assert dry.exit_code == 2, dry.output
    listed = dry.output.partition("missing inputs (")[2]
    for text in (listed, error):
        assert "eval.overrides: split=nosuch" in text and "train, dev, test" in text, text


def test_eval_generation_vllm_without_vllm_is_refused_by_the_dry_run(cli, tmp_path, monkeypatch):
    """eval.overrides=[generation=vllm] on a machine without vLLM passed the dry run; every eval stage would stop."""
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else found(name, *a)
    )
    dry, error = _experiment(cli, tmp_path, "eval.overrides=[generation=vllm]")
    assert dry.exit_code == 2, dry.output
    listed = dry.output.partition("missing inputs (")[2]
    for text in (listed, error):
        assert "eval.overrides: generation=vllm needs vLLM" in text and "generation=hf" in text, text


@pytest.mark.parametrize(
    "uri, words",
    [
        ("sqlite:////proc/nosuch/mlflow.db", ["folder /proc/nosuch does not exist"]),
        ("file:///proc/zerosim-store", ["/proc is not writable"]),
        ("http://127.0.0.1:9", ["no answer"]),
    ],
)
def test_eval_checks_the_mlflow_store_before_any_work(cli, monkeypatch, uri, words):
    """`zerosim eval` tried the store only after the search engine's preflight and every dataset had been read
    (32-36 s): it is tried first, as `zerosim train` does."""
    import eval.run
    import zerosim.engines

    def work(*args, **kwargs):
        raise AssertionError("work began before the MLflow store was checked")

    monkeypatch.setattr(zerosim.engines, "preflight", work)
    monkeypatch.setattr(eval.run, "load_datasets", work)
    result = cli("eval", "--search", "bm25", f"tracking.tracking_uri={uri}")
    _fails_cleanly(result, f"tracking.tracking_uri={uri}", *words)
