"""Cold-start SFT data: the same token pieces as the rollout, observations masked out of the loss."""

from zerosim.agent.protocol import parse_action
from zerosim.agent.rollout import ProtocolTokens, build_prompt
from zerosim.core.data.qa import QAExample
from zerosim.core.search import Document
from zerosim.training.warmstart import IGNORE_INDEX, build_examples


class Engine:
    def __init__(self):
        self.calls = 0

    def search(self, requests, k):
        self.calls += 1
        return [
            [Document(f"d{i}", "Peru", f"ZZINFO the capital of Peru is Lima {i}") for i in range(k)]
            for _ in requests
        ]


def test_examples_mask_prompt_and_observations(tokenizer):
    questions = [QAExample(f"q{i}", f"What is the capital of Peru {i}?", ("Lima",), {}) for i in range(5)]
    engine = Engine()
    rows = build_examples(questions, engine, tokenizer, k=2, max_obs_tokens=64, seed=0, batch_size=2)
    assert len(rows) == 5 and engine.calls == 3  # batched searches
    tokens = ProtocolTokens(tokenizer, 64)
    for row, q in zip(rows, questions, strict=True):
        ids, labels = row["input_ids"], row["labels"]
        assert len(ids) == len(labels)
        prompt = tokens.prompt(build_prompt(q.question))
        assert ids[: len(prompt)] == prompt and set(labels[: len(prompt)]) == {IGNORE_INDEX}
        trained = [t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
        assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=True))
        masked_text = tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX])
        trained_text = tokenizer.decode(trained)
        assert (
            "ZZINFO" in masked_text and "ZZINFO" not in trained_text and "<information>" not in trained_text
        )
        assert trained[-1] == tokenizer.eos_token_id
        assert parse_action(trained_text.split("</search>")[0] + "</search>")[0] == "search"
        assert parse_action(trained_text)[0] == "answer" and "Lima" in trained_text


def _warmstart_files(tmp_path):
    import json

    qa = tmp_path / "qa.jsonl"
    qa.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"Capital of {i}?", "golden_answers": ["Lima"]}) + "\n"
            for i in range(6)
        )
    )
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "contents": f"C{i}\nThe capital of {i} is Lima."}) + "\n"
            for i in range(6)
        )
    )
    return qa, corpus


def test_cli_warmstart_writes_checkpoint(tmp_path, tiny_model_dir, mlflow_db, zerosim_cli):
    import mlflow

    qa, corpus = _warmstart_files(tmp_path)
    cmd = [
        "policy", "warmstart", f"policy.model={tiny_model_dir}",
        f"warmstart.data={qa}", f"warmstart.search.bm25.corpus={corpus}", "warmstart.max_steps=2",
        "warmstart.batch_size=2", "warmstart.num_examples=4", f"run.output_dir={tmp_path / 'out'}", "run.name=ws",
        f"tracking.tracking_uri={mlflow_db}",
    ]  # fmt: skip
    zerosim_cli(*cmd)
    ckpt = tmp_path / "out" / "ws" / "warmstart" / "final"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer_config.json").is_file()
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["zerosim"], output_format="list")
    assert run.data.tags["zerosim.job"] == "warmstart" and "train_loss" in run.data.metrics
    assert not (tmp_path / "out" / "ws" / "warmstart" / "trainer").exists()


def test_grounded_examples_answer_only_what_the_documents_show(tokenizer):
    class Mixed:
        def search(self, requests, k):
            out = []
            for r in requests:
                text = "Peru: capital Lima" if "Peru" in r.query else "Chile is long and narrow"
                out.append([Document("d", "t", text + " | filler" * 40)] * k)
            return out

    questions = [
        QAExample("p", "What is the capital of Peru?", ("City of Lima", "Lima"), {}),
        QAExample("c", "What is the capital of Chile?", ("Santiago",), {}),
        QAExample("p2", "Peru capital city?", ("Lima",), {}),
    ]
    rows = build_examples(questions, Mixed(), tokenizer, k=1, max_obs_tokens=24, grounded=True)
    assert len(rows) == 2  # Chile's documents never show Santiago: no trajectory for it
    trained = [
        tokenizer.decode(
            [t for t, lab in zip(r["input_ids"], r["labels"], strict=True) if lab != IGNORE_INDEX]
        )
        for r in rows
    ]
    assert all(parse_action(t)[1] == "Lima" for t in trained)  # the gold answer the documents hold
    assert len(build_examples(questions, Mixed(), tokenizer, k=1, max_obs_tokens=24, limit=1)) == 1
    # ungrounded keeps every question and writes its first gold answer
    assert len(build_examples(questions, Mixed(), tokenizer, k=1, max_obs_tokens=24)) == 3


def test_the_warm_start_refuses_to_step_bf16_weights(
    tmp_path, tiny_model_dir, mlflow_db, zerosim_cli, monkeypatch
):
    """Its SFT optimizer must step fp32 weights (small updates round away in bf16): checked as training begins."""
    import torch

    import zerosim.core.models as models

    load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: load(*a, **k).to(torch.bfloat16))
    qa, corpus = _warmstart_files(tmp_path)
    result = zerosim_cli(
        "policy", "warmstart", f"policy.model={tiny_model_dir}", f"warmstart.data={qa}",
        f"warmstart.search.bm25.corpus={corpus}", "warmstart.max_steps=2", "warmstart.batch_size=2",
        "warmstart.num_examples=4", f"run.output_dir={tmp_path / 'out'}", "run.name=ws",
        f"tracking.tracking_uri={mlflow_db}", code=2,
    )  # fmt: skip
    assert "bfloat16" in result.stderr and "policy.dtype" in result.stderr, result.stderr
    assert not (tmp_path / "out" / "ws" / "warmstart" / "final").exists()


def test_the_warm_start_logs_its_policy_when_asked(tmp_path, tiny_model_dir, mlflow_db, zerosim_cli):
    """tracking.log_model=true was dropped by `zerosim policy warmstart` (and so for an experiment's rl: false
    arms, which evaluate the warm start): its policy is the run's model now."""
    import mlflow

    qa, corpus = _warmstart_files(tmp_path)
    zerosim_cli(
        "policy", "warmstart", f"policy.model={tiny_model_dir}", f"warmstart.data={qa}",
        f"warmstart.search.bm25.corpus={corpus}", "warmstart.max_steps=1", "warmstart.batch_size=2",
        "warmstart.num_examples=2", f"run.output_dir={tmp_path / 'out'}", "run.name=ws",
        f"tracking.tracking_uri={mlflow_db}", "tracking.log_model=true",
    )  # fmt: skip
    mlflow.set_tracking_uri(mlflow_db)
    (run,) = mlflow.search_runs(experiment_names=["zerosim"], output_format="list")
    assert run.data.tags["zerosim.job"] == "warmstart" and run.data.tags.get("zerosim.model_uri")


def test_tools_demonstrations_are_the_tokens_the_tools_rollout_writes_for_the_same_actions(tokenizer):
    """rollout.protocol=tools: a demonstration replayed through the rollout — its trained segments as the policy's
    turns, the same engine — gives the same tokens, trained exactly where the rollout's mask is 1."""
    from zerosim.agent.rollout import Protocol, RolloutConfig, SearchRollout
    from zerosim.core.generation import Generation

    config = RolloutConfig(
        protocol=Protocol.tools, max_turns=3, max_new_tokens=200, max_completion_tokens=900
    )
    question = QAExample("q0", "What is the capital of Peru?", ("Lima",), {})
    [row] = build_examples([question], Engine(), tokenizer, k=2, max_obs_tokens=64, rollout=config)
    ids, labels = row["input_ids"], row["labels"]
    turns, current = [], []
    for t, lab in zip(ids, labels, strict=True):
        if lab != IGNORE_INDEX:
            current.append(t)
        elif current:
            turns, current = [*turns, current], []
    turns += [current] if current else []
    assert len(turns) == 2  # the call, then the answer

    class Replay:
        def generate(self, prompts, max_new_tokens):
            turn = turns.pop(0)
            return [Generation(turn, [0.0] * len(turn), "eos")]

    loop = SearchRollout(
        tokenizer, Engine(), config=config, k=2,
        examples={build_prompt(question.question): (question.question, question.golden_answers)},
    )  # fmt: skip
    [traj], _ = loop.run(Replay(), [build_prompt(question.question)], step=0)
    assert traj.prompt_ids + traj.completion_ids == ids
    assert [lab != IGNORE_INDEX for lab in labels[len(traj.prompt_ids) :]] == [m == 1 for m in traj.env_mask]
    assert traj.searches == 1 and traj.answer == "Lima" and traj.valid_format
