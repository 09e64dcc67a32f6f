"""fairseq_feedback_cli.outputs: outputs that appear complete or not at all."""

import os
import stat

import pytest
from helpers import error_of

from fairseq_feedback_cli import average_checkpoints, curves, evaluate_toy
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


def same_by_path(tmp_path, name):
    return tmp_path / name


def same_by_symbolic_link(tmp_path, name):
    os.symlink(tmp_path / name, tmp_path / f"link-to-{name}")
    return tmp_path / f"link-to-{name}"


def same_by_hard_link(tmp_path, name):
    os.link(tmp_path / name, tmp_path / f"hard-{name}")
    return tmp_path / f"hard-{name}"


# (tool, its command line with {OUT} where the output goes, the input OUT names), checked before any work
OVERWRITES = {
    "evaluate-toy over its checkpoint": (evaluate_toy.main, ["--task", "copy", "--data", "data", "--path", "ck.pt",
                                                            "--output", "{OUT}"], "ck.pt", "--path"),
    "evaluate-toy over its labels": (evaluate_toy.main, ["--task", "copy", "--data", "data", "--path", "ck.pt",
                                                        "--raw", "test.labels", "--output", "{OUT}"], "test.labels",
                                     "--raw"),
    "evaluate-toy over its data": (evaluate_toy.main, ["--task", "copy", "--data", "data", "--path", "ck.pt",
                                                      "--output", "{OUT}"], "data", "--data"),
    "average-checkpoints over an input": (average_checkpoints.main, ["--inputs", "ck.pt", "ck2.pt", "--output",
                                                                     "{OUT}"], "ck2.pt", "--inputs"),
    "curves over a log": (curves.main, ["log", "train.log", "--out", "{OUT}"], "train.log", "inputs"),
}


@pytest.mark.parametrize("same", [same_by_path, same_by_symbolic_link, same_by_hard_link],
                         ids=["by path", "by symbolic link", "by hard link"])
@pytest.mark.parametrize("tool, argv, read, option", OVERWRITES.values(), ids=OVERWRITES.keys())
def test_no_tool_writes_over_one_of_its_own_inputs(tmp_path, monkeypatch, tool, argv, read, option, same):
    """feedback-evaluate-toy --output CK/checkpoint_last.pt replaced the checkpoint with predictions, exit 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("ck.pt", "ck2.pt", "test.labels", "train.log"):
        (tmp_path / name).write_text(f"the {name} the tool reads")
    if same is same_by_hard_link and read == "data":
        pytest.skip("a folder has no hard links")
    out = same(tmp_path, read)
    message = error_of(tool, [str(out) if a == "{OUT}" else a for a in argv])
    assert f" {out} would write over {option} {read}, which this command reads: pass another path" in message
    assert (tmp_path / read).is_dir() if read == "data" else (
        (tmp_path / read).read_text() == f"the {read} the tool reads")
