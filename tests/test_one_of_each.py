"""One of each (issue 17): one JSON-lines reader/writer with one error type, one answer-tag parser, one
chat-template encoder — and every former copy now goes through it."""

from __future__ import annotations

import re

import pytest

from zerosim.core.data.jsonl import DataError, read_jsonl, write_jsonl

# -- JSON lines ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [b'{"a": 1}', b"", b'{"a": 2'],
            "line 3: invalid JSON (Expecting ',' delimiter at column 8); each line must be one complete JSON object",
        ),
        ([b'{"a": 1}', b"[1, 2]"], "line 2: each row must be a JSON object (got list)"),
        (
            [b'{"a": 1}', b'{"a": "caf\xe9"}'],
            "line 2: not UTF-8 text (byte 0xe9, byte 11 of the line); save the file as UTF-8",
        ),
    ],
)
def test_read_jsonl_names_file_line_and_fix(tmp_path, lines, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as error:
        read_jsonl(path)
    assert str(error.value) == f"{path} {message}"


def test_read_jsonl_missing_file_bom_and_blank_lines(tmp_path):
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path / 'nope.jsonl'}: no such file; check the path")
    ):
        read_jsonl(tmp_path / "nope.jsonl")
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n  \n{"b": "\xc3\xa9"}')  # BOM, blank lines, no final newline
    assert read_jsonl(path) == [{"a": 1}, {"b": "é"}]


def test_write_jsonl_round_trips_utf8_and_replaces_atomically(tmp_path):
    path = tmp_path / "out" / "rows.jsonl"
    rows = [{"q": "Zürich?", "n": 1}, {"n": 2, "q": "Lima"}]
    write_jsonl(path, iter(rows))  # any iterable, streamed
    assert path.read_text(encoding="utf-8") == '{"q": "Zürich?", "n": 1}\n{"n": 2, "q": "Lima"}\n'
    assert read_jsonl(path) == rows
    write_jsonl(path, rows, sort_keys=True)
    assert path.read_text(encoding="utf-8").splitlines()[0] == '{"n": 1, "q": "Zürich?"}'

    before = path.read_bytes()
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        write_jsonl(path, [{"ok": 1}, {"bad": {1, 2}}])  # fails after a row was written
    assert path.read_bytes() == before  # the old file, untouched
    assert [p.name for p in path.parent.iterdir()] == ["rows.jsonl"]  # no temporary file left behind


def test_every_jsonl_reader_raises_the_one_data_error(tmp_path):
    """The SFT reader (once ``DatasetError``), the QA loader and the experiment's score reader share it."""
    import simulators.sft
    from simulators.sft import load_sft_dataset
    from zerosim.core.data import load_qa
    from zerosim.experiment.report import _scores

    assert not hasattr(simulators.sft, "DatasetError")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('\nnot json\n{"prompt": "p", "completion": "c"}\n')
    for read in (load_sft_dataset, load_qa, _scores):
        with pytest.raises(DataError, match=re.escape(f"{bad} line 2: invalid JSON")):
            read(bad)
    with pytest.raises(DataError, match="zerosim simulator collect"):  # the caller's own fix, kept
        load_sft_dataset(tmp_path / "missing.jsonl")


def test_every_jsonl_writer_writes_what_read_jsonl_reads(tmp_path, monkeypatch):
    """collect's dataset, eval's questions.jsonl, quality's samples and MLflow artifacts: one line format."""
    from zerosim.core import tracking

    logged = {}
    monkeypatch.setattr("mlflow.log_text", lambda text, name: logged.update({name: text}))
    rows = [{"b": "é", "a": 1}]
    tracking.log_jsonl(rows, "samples.jsonl")
    assert logged["samples.jsonl"] == '{"a": 1, "b": "é"}\n'  # keys sorted, UTF-8 kept
    write_jsonl(tmp_path / "x.jsonl", rows, sort_keys=True)
    assert (tmp_path / "x.jsonl").read_text(encoding="utf-8") == logged["samples.jsonl"]


# -- the answer-tag parser -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer", "action"),
    [
        ("<think>x</think><answer> Lima </answer>", "Lima", ("answer", "Lima")),
        ("<answer>a</answer> more <answer>\n b \n</answer>", "b", ("answer", "b")),  # the last one
        ("<answer>unterminated", None, ("invalid", "")),  # only complete pairs count
        ("<answer>a</answer><answer>unterminated", "a", ("answer", "a")),
        ("<answer>  </answer>", "", ("answer", "")),  # an empty answer is still an answer
        ("<search>  </search>", None, ("invalid", "")),  # an empty query is not a search
        ("<search>q</search> then <answer>b</answer>", "b", ("answer", "b")),
        # on purpose: the turn's action is its last tag of either kind, the text's answer its last <answer>
        ("<answer>a</answer> <search> q </search>", "a", ("search", "q")),
        ("<search> x <answer> y </answer> </search>", "y", ("search", "x <answer> y </answer>")),
        ("<Answer>a</Answer>", None, ("invalid", "")),  # tags are case-sensitive
        ("", None, ("invalid", "")),
    ],
)
def test_one_tag_parser(text, answer, action):
    from eval.harness import _prediction
    from zerosim.agent.protocol import extract_answer, last_tag, parse_action

    assert extract_answer(text) == answer
    assert parse_action(text) == action
    assert last_tag(text, ("answer",)) == (None if answer is None else ("answer", answer))
    # eval's prediction: the same answer when tagged, else the first non-empty line, untagged
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    assert _prediction(text) == ((answer, True) if answer is not None else (first_line, False))


def test_rewards_and_rollout_keep_no_parser_of_their_own():
    import zerosim.agent.rewards
    import zerosim.agent.rollout

    assert not hasattr(zerosim.agent.rewards, "ANSWER_RE") and not hasattr(
        zerosim.agent.rollout, "_ACTION_RE"
    )


# -- the chat-template encoder ---------------------------------------------------------------------------------


def test_one_chat_encoder_gives_the_ids_every_old_path_gave(tokenizer, tiny_model_dir):
    from eval.harness import DIRECT_PROMPT, Evaluator
    from simulators.backends import TransformersBackend
    from zerosim.agent.rollout import ProtocolTokens, build_prompt
    from zerosim.core.data.qa import QAExample
    from zerosim.core.generation import Generation
    from zerosim.core.models import encode_chat_prompt, format_chat_prompt, load_causal_lm
    from zerosim.job_config import EvalConfig

    text = build_prompt("What is the capital of Peru?")
    messages = [{"role": "user", "content": text}]
    # what ProtocolTokens.prompt, Evaluator._encode and TransformersBackend.encode each computed before
    old_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    # what simulators.backends.chat_format (the vLLM path's text) computed before
    old_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = encode_chat_prompt(tokenizer, text)
    assert ids == old_ids and all(isinstance(i, int) for i in ids)
    assert format_chat_prompt(tokenizer, text) == old_text
    assert tokenizer(old_text, add_special_tokens=False)["input_ids"] == ids  # text and ids agree
    assert ProtocolTokens(tokenizer, 8).prompt(text) == ids
    model = load_causal_lm(str(tiny_model_dir), "float32")
    assert TransformersBackend(model, tokenizer).encode(text) == ids
    assert not hasattr(Evaluator, "_encode")  # the harness encodes with encode_chat_prompt too

    seen = []  # what the harness hands its generator for a direct question
    evaluator = Evaluator(EvalConfig(method="direct", batch_size=1), model, tokenizer, None)
    answer = tokenizer("<answer> Lima </answer>", add_special_tokens=False)["input_ids"]

    def generate(prompts, max_new_tokens):
        seen.extend(prompts)
        return [Generation(answer, [0.0] * len(answer), "stop") for _ in prompts]

    evaluator.answer_generator.generate = generate
    [row] = evaluator.direct([QAExample("q1", "Capital of Peru?", ("Lima",))])
    assert row.prediction == "Lima" and row.tagged
    assert seen == [encode_chat_prompt(tokenizer, DIRECT_PROMPT.format(question="Capital of Peru?"))]
