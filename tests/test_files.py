"""fairseq_feedback_cli.outputs: outputs that appear complete or not at all."""

import os
import stat

import pytest

from fairseq_feedback_cli.outputs import atomic_file, atomic_folder


class Interrupted(Exception):
    pass


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield
    os.umask(previous)


def test_a_file_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "out.txt"
    with atomic_file(out) as f:
        f.write("first")
        assert not out.exists()
    assert out.read_text() == "first"
    with pytest.raises(Interrupted):
        with atomic_file(out) as f:
            f.write("half of the second")
            raise Interrupted
    assert out.read_text() == "first" and os.listdir(tmp_path) == ["out.txt"]


def test_a_folder_appears_complete_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with atomic_folder(out) as building:
        (building / "a").write_text("first")
        assert not out.exists()
    assert (out / "a").read_text() == "first"
    with pytest.raises(Interrupted):
        with atomic_folder(out) as building:
            (building / "a").write_text("half of the second")
            raise Interrupted
    assert (out / "a").read_text() == "first" and os.listdir(tmp_path) == ["out"]
    with atomic_folder(out) as building:
        (building / "b").write_text("second")
    assert os.listdir(out) == ["b"] and os.listdir(tmp_path) == ["out"]


def test_what_a_killed_run_left_is_removed_by_the_next(tmp_path):
    (tmp_path / "out.tmp").mkdir()
    (tmp_path / "out.tmp" / "stale").write_text("from a run killed half-way")
    with atomic_folder(tmp_path / "out") as building:
        assert os.listdir(building) == []
    assert os.listdir(tmp_path) == ["out"]


def test_outputs_get_the_umasks_permissions(tmp_path, umask_027):
    with atomic_file(tmp_path / "file") as f:
        f.write("x")
    with atomic_folder(tmp_path / "folder"):
        pass
    assert mode(tmp_path / "file") == 0o640 and mode(tmp_path / "folder") == 0o750


def test_the_check_runs_again_before_replacing(tmp_path):
    out = tmp_path / "out"

    def only_empty_or_absent(path):
        if path.exists() and os.listdir(path):
            raise Interrupted(f"{path} is not empty")

    with pytest.raises(Interrupted):
        with atomic_folder(out, check=only_empty_or_absent) as building:
            (building / "result").write_text("new")
            out.mkdir()
            (out / "precious").write_text("someone else's")  # appeared while we were building
    assert os.listdir(out) == ["precious"] and os.listdir(tmp_path) == ["out"]
