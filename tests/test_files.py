"""fairseq_feedback_cli.outputs: outputs that appear complete or not at all."""

import argparse
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
from helpers import ENV, assert_one_error_line, error_lines, error_of

from fairseq_feedback_cli import average_checkpoints, curves
from fairseq_feedback_cli.toy import evaluate as evaluate_toy
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


def refused_write_inputs(tmp_path):
    """What the tools below read: two checkpoints, a fairseq json log."""
    for seed, name in enumerate(("a.pt", "b.pt")):
        torch.save({"args": argparse.Namespace(arch="feedback_transformer"), "model": {"w": torch.randn(64, 64)},
                    "optimizer_history": [{"num_updates": seed}], "extra_state": {"epoch": seed}}, tmp_path / name)
    (tmp_path / "train.log").write_text("".join(
        json.dumps({"epoch": 1, "valid_ppl": 100 - u, "valid_num_updates": u, "wall": u}) + "\n" for u in (10, 20)))


# (module, its command line with {OUT} where its output goes), each writing far more than 4 KiB
REFUSED_WRITES = {
    "average-checkpoints": ("average_checkpoints", ["--inputs", "a.pt", "b.pt", "--output", "{OUT}"]),
    "curves": ("curves", ["log", "train.log", "--out", "{OUT}"]),
    "a data script": ("data_prep.synthetic_translation", ["--out", "{OUT}", "--train", 3000]),
    "the toy tasks": ("data_prep.toy_tasks", ["copy", "--out", "{OUT}"]),
}


@pytest.mark.parametrize("module, argv", REFUSED_WRITES.values(), ids=REFUSED_WRITES.keys())
@pytest.mark.slow
def test_a_write_the_system_refuses_midway_is_one_line_and_leaves_nothing(tmp_path, module, argv):
    """Under a file-size limit (ulimit -f), as on a disk that fills, writes fail midway: each tool ends in
    one line naming its output and the fix, and leaves nothing that looks finished (tracebacks before)."""
    refused_write_inputs(tmp_path)
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", f"fairseq_feedback_cli.{module}",
                           *(str(out) if a == "{OUT}" else str(a) for a in argv)], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert_one_error_line(proc)
    assert f"could not write {out}" in error_lines(proc)[0] and "ulimit -f" in error_lines(proc)[0]
    assert sorted(os.listdir(tmp_path)) == before


def test_an_output_that_is_a_device_is_written_not_replaced(tmp_path):
    """--output /dev/null replaced the device with a file of the predictions (as root, /dev/null itself)."""
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's device
    except PermissionError:
        pytest.skip("only root makes device nodes")
    with atomic_file(null) as f:
        f.write("predictions")
    assert stat.S_ISCHR(os.stat(null).st_mode) and os.listdir(tmp_path) == ["null"]
    full = tmp_path / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full's: every write fails, the disk full
    with pytest.raises(OSError) as refused:
        with atomic_file(full) as f:
            f.write("predictions")
            f.flush()
    assert refused.value.filename == str(full) and stat.S_ISCHR(os.stat(full).st_mode)


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_leaves_nothing(tmp_path):
    """Ctrl-C while a data script writes (synthetic_translation): a traceback before."""
    out = tmp_path / "corpus"
    proc = subprocess.Popen([sys.executable, "-m", "fairseq_feedback_cli.data_prep.synthetic_translation", "--out",
                             str(out), "--train", "3000000"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal
    deadline = time.time() + 120
    while not any(tmp_path.iterdir()) and time.time() < deadline:  # writing
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "error: interrupted"), err
    assert list(tmp_path.iterdir()) == []
