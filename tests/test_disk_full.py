"""A disk that fills during an index build or a checkpoint save: one line naming where, how much is free and
the way out — never a library's message (torch's "PytorchStreamWriter failed writing file") — and nothing
half-written left behind."""

from __future__ import annotations

import errno
import json
import re

import pytest

from zerosim.core.fsutil import DiskFullError, WriteFaultError, named_write_fault, no_space

TORCH_WORDS = "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/3: file write failed"


@pytest.mark.parametrize(
    ("exc", "full"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (RuntimeError(TORCH_WORDS), True),  # torch's writer, no errno
        (OSError(errno.EACCES, "Permission denied"), False),
        (ValueError("something else"), False),
    ],
)
def test_a_full_disk_is_told_apart_from_other_failures(exc, full):
    assert no_space(exc) is full
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = exc
    assert no_space(wrapped) is full


@pytest.mark.parametrize(
    ("fault", "words"),
    [
        (errno.ENOSPC, "writing bm25: the disk holding"),
        (errno.EFBIG, "met a file-size limit (EFBIG: File too large); raise the limit (`ulimit -f`"),
        (errno.EROFS, "is on a read-only file system (EROFS"),
    ],
)
def test_an_index_build_meeting_a_write_fault_names_it_and_leaves_nothing(
    fault, words, tmp_path, monkeypatch, zerosim_cli
):
    import os

    import eval.index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"id": f"p{i}", "contents": f"T{i}\nText {i}."}) + "\n" for i in range(5))
    )

    def full(*args, **kwargs):
        raise OSError(fault, os.strerror(fault), str(tmp_path / "indexes" / "docs.jsonl"))

    monkeypatch.setattr(eval.index, "write_docs", full)
    out = tmp_path / "indexes" / "bm25"
    result = zerosim_cli(
        "index", "build", "--corpus", str(corpus), "--kind", "bm25", "--out", str(out), code=2
    )
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line, line
    assert words in line and "nothing was left half-written" in line, line
    assert "MiB free" in line or fault != errno.ENOSPC
    assert not out.exists() and list((tmp_path / "indexes").iterdir()) == []  # no temporary folder left


def test_a_checkpoint_save_that_fills_the_disk_says_how_to_resume(
    tmp_path, tiny_model_dir, capitals, mlflow_db, monkeypatch, zerosim_cli
):
    import transformers

    qa, corpus = capitals(8)

    def full(self, *args, **kwargs):
        raise RuntimeError(TORCH_WORDS)

    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", full)
    result = zerosim_cli(
        "train", f"policy.model={tiny_model_dir}", "search.engine=bm25", f"search.bm25.corpus={corpus}",
        f"data.train={qa}", "trainer.max_steps=2", "trainer.save_steps=1", "trainer.per_device_train_batch_size=2",
        "trainer.num_generations=2", "rollout.max_new_tokens=6", "rollout.max_turns=1",
        "rollout.max_completion_tokens=64", "warmstart.enabled=false", "validation.every=0",
        f"run.output_dir={tmp_path / 'out'}", f"tracking.tracking_uri={mlflow_db}", code=2,
    )  # fmt: skip
    error = re.findall(r"error: [^\r\n]*", result.stderr)  # after the progress bars' last \r
    assert len(error) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "saving a checkpoint: the disk holding" in error[0] and "resume=true" in error[0]


def test_the_named_error_keeps_what_it_was_raised_from(tmp_path):
    with pytest.raises(DiskFullError) as raised, named_write_fault(tmp_path / "x", "writing x", "then again"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value.__cause__, OSError)
    assert str(raised.value).startswith(f"writing x: the disk holding {tmp_path / 'x'} is full (")


def test_a_write_fault_keeps_its_errno_and_names_the_file_it_met():
    with pytest.raises(WriteFaultError) as raised, named_write_fault("/out", "exporting", "then run again"):
        raise OSError(errno.EROFS, "Read-only file system", "/out/a/stage.json")
    assert raised.value.errno == errno.EROFS and isinstance(raised.value.__cause__, OSError)
    assert str(raised.value) == (
        "exporting: /out/a/stage.json is on a read-only file system (EROFS: Read-only file system); write "
        "elsewhere (or remount it read-write), then run again"
    )
    with pytest.raises(ValueError), named_write_fault("/out", "exporting", "then run again"):
        raise ValueError("not a write fault")
