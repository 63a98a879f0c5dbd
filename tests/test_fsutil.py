import pytest

from zerosim.fsutil import atomic_directory


def test_success_replaces_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (target / "new.txt").exists()  # nothing visible until done
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_leaves_target_and_no_temp(tmp_path, exc):
    target = tmp_path / "out"
    with pytest.raises(type(exc)), atomic_directory(target) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise exc
    assert list(tmp_path.iterdir()) == []
