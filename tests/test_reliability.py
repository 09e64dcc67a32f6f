"""Faults lose nothing: checkpoints are complete or absent, a truncated
checkpoint_last.pt is passed over, a resumed run equals an uninterrupted one,
the streaming LM refuses to resume in another layout; the one-line errors
stay inside the command-line tools; and whose exception it is (fairseq's, in
one line; this plugin's, with its traceback) is told where it was raised,
in a rank that fairseq spawned or a DataLoader worker too."""

import functools
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch
from helpers import ENV, LM_MODEL, PLUGIN, TRANSLATION_MODEL, error_lines, last_number, run, train_on_two_workers

from fairseq.data import Dictionary

from fairseq_feedback.fairseq_fixes.checkpoints import checkpoint_to_resume
from fairseq_feedback.fairseq_fixes.one_line import one_line
from fairseq_feedback.fairseq_fixes.runs import held
from fairseq_feedback.tasks.splits import monolingual_split

# SGD and no dropout: parameters of two runs on the same batches are equal, not
# only close (Adam rescales float noise of zero gradients into full steps)
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--disable-validation"]
TRANSLATION = [*TRANSLATION_MODEL, *SGD, "--batch-size", 8, "--required-batch-size-multiple", 1]


def parameters(save_dir):
    return torch.load(save_dir / "checkpoint_last.pt")["model"]


def assert_same_parameters(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


# ---------------------------------------------------------------- checkpoints


def test_a_copy_cut_short_leaves_the_old_checkpoint_in_place(tmp_path, monkeypatch):
    """fairseq's save_checkpoint copies its first file to the other names with
    checkpoint_utils.PathManager.copy; here a Ctrl-C arrives halfway."""
    from fairseq import checkpoint_utils

    new, last = tmp_path / "checkpoint_1_20.pt", tmp_path / "checkpoint_last.pt"
    torch.save({"model": {"w": torch.ones(100_000)}}, new)
    torch.save({"model": {"w": torch.zeros(100_000)}}, last)
    sendfile = os.sendfile

    def interrupted(out_fd, in_fd, offset, count):
        sendfile(out_fd, in_fd, offset, os.fstat(in_fd).st_size // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "sendfile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_utils.PathManager.copy(str(new), str(last), overwrite=True)
    monkeypatch.undo()
    assert torch.load(last)["model"]["w"].sum() == 0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_20.pt", "checkpoint_last.pt"]


KILL_DURING_THE_COPY = """
import os, runpy, signal, sys

sendfile = os.sendfile

def killed(out_fd, in_fd, offset, count):
    # kill -9 halfway through copying update 6's checkpoint to checkpoint_last.pt
    if os.readlink(f"/proc/self/fd/{in_fd}").endswith("checkpoint_1_6.pt") and \\
            "checkpoint_last" in os.readlink(f"/proc/self/fd/{out_fd}"):
        sendfile(out_fd, in_fd, offset, os.fstat(in_fd).st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return sendfile(out_fd, in_fd, offset, count)

os.sendfile = killed
sys.argv = ["fairseq-train", *sys.argv[1:]]
runpy.run_module("fairseq_cli.train", run_name="__main__")
"""


@pytest.fixture(scope="module")
def killed_run(translation_data, tmp_path_factory):
    """fairseq-train killed while it copies its second checkpoint (update 6)
    to checkpoint_last.pt; the first (update 3) is complete."""
    save_dir = tmp_path_factory.mktemp("killed")
    args = [translation_data, *TRANSLATION, "--save-interval-updates", 3, "--max-update", 6,
            "--save-dir", save_dir, "--user-dir", PLUGIN]
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_THE_COPY, *map(str, args)], env=ENV,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return save_dir


@pytest.fixture(scope="module")
def cut_short(translation_data, tmp_path_factory):
    """What killed_run leaves (test_a_killed_save_leaves_every_checkpoint_complete), made in this process for
    the tests of what a run resumes from: the checkpoints of updates 3 and 6 complete, checkpoint_last.pt
    still update 3's, as the kill during its copy of update 6's left it."""
    save_dir = tmp_path_factory.mktemp("cut-short")
    run("train", translation_data, *TRANSLATION, "--save-interval-updates", 3, "--max-update", 6,
        "--save-dir", save_dir)
    shutil.copyfile(save_dir / "checkpoint_1_3.pt", save_dir / "checkpoint_last.pt")
    return save_dir


def updates(path):
    return torch.load(path)["optimizer_history"][-1]["num_updates"]


@pytest.mark.slow
def test_a_killed_save_leaves_every_checkpoint_complete(killed_run):
    finished = sorted(name for name in os.listdir(killed_run) if name.endswith(".pt"))
    assert finished == ["checkpoint_1_3.pt", "checkpoint_1_6.pt", "checkpoint_last.pt"]
    assert [updates(killed_run / name) for name in finished] == [3, 6, 3]


def set_times_against_the_updates(save_dir):
    """File times in the reverse order of the updates the checkpoints record: what a copy (cp -r), a backup or
    a sync can leave, which sets the times in its own order."""
    checkpoints = [name for name in os.listdir(save_dir) if name.endswith(".pt")]
    for i, name in enumerate(sorted(checkpoints, key=lambda name: -updates(save_dir / name))):
        os.utime(save_dir / name, (1_700_000_000 + i, 1_700_000_000 + i))


@pytest.mark.parametrize("last", ["behind", "missing"])
def test_after_a_save_cut_short_training_resumes_from_the_furthest_complete_checkpoint(cut_short, translation_data,
                                                                                        tmp_path, last):
    """The kill left checkpoint_last.pt at update 3 beside a complete copy of update 6; a disk that filled
    during a save left checkpoint_best.pt complete and checkpoint_last.pt missing, and the next run trained
    from scratch over checkpoint_best.pt. A run resumes from the complete checkpoint of the same run that
    records the most updates, whatever the files' times, and says so."""
    shutil.copytree(cut_short, tmp_path, dirs_exist_ok=True)
    set_times_against_the_updates(tmp_path)
    if last == "missing":
        (tmp_path / "checkpoint_last.pt").unlink()
    proc = run("train", translation_data, *TRANSLATION, "--max-update", 8, "--save-dir", tmp_path)
    warnings = [line for line in proc.stdout.splitlines() if "the furthest complete checkpoint" in line]
    why = {"behind": "records 3 updates, and checkpoint_1_6.pt, a later save of the same run, 6 (a save was cut "
                     "short)", "missing": "is missing (a save was cut short, or it was deleted)"}[last]
    assert len(warnings) == 1 and f"{tmp_path / 'checkpoint_last.pt'} {why}: " in warnings[0], proc.stdout
    assert warnings[0].endswith(f"resuming from {tmp_path / 'checkpoint_1_6.pt'} (6 updates), the furthest complete "
                                "checkpoint of this run; to start over, pass another --save-dir")
    assert "@ 6 updates" in proc.stdout and last_number(r"num_updates (\d+)", proc.stdout) == 8


def test_a_truncated_checkpoint_last_is_passed_over_for_the_furthest_complete_one(cut_short, translation_data,
                                                                                     tmp_path):
    shutil.copytree(cut_short, tmp_path, dirs_exist_ok=True)
    set_times_against_the_updates(tmp_path)  # checkpoint_1_3.pt the newest file
    last = tmp_path / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    proc = run("train", translation_data, *TRANSLATION, "--max-update", 8, "--save-dir", tmp_path)
    warnings = [line for line in proc.stdout.splitlines() if "is truncated" in line]  # fairseq-train logs to stdout
    assert len(warnings) == 1, proc.stdout[-3000:]
    assert f"{last} is truncated (a save was cut short): resuming from {tmp_path / 'checkpoint_1_6.pt'} (6 updates)" \
           in warnings[0]
    assert "@ 6 updates" in proc.stdout and last_number(r"num_updates (\d+)", proc.stdout) == 8
    assert updates(last) == 8


def test_a_save_dir_copied_with_cp_r_resumes_from_checkpoint_last(cut_short, translation_data, tmp_path):
    """A finished run's folder, copied with cp -r (new times, in copy order): a checkpoint_best.pt of update 3
    came out newer than checkpoint_last.pt of update 6, and the run resumed from update 3 with a warning, then
    wrote over checkpoint_last.pt. It resumes from checkpoint_last.pt, without a word, as fairseq does."""
    finished = tmp_path / "finished"
    shutil.copytree(cut_short, finished)
    shutil.copyfile(finished / "checkpoint_1_6.pt", finished / "checkpoint_last.pt")
    shutil.copyfile(finished / "checkpoint_1_3.pt", finished / "checkpoint_best.pt")
    subprocess.run(["cp", "-r", finished, tmp_path / "copy"], check=True)
    set_times_against_the_updates(tmp_path / "copy")
    proc = run("train", translation_data, *TRANSLATION, "--max-update", 8, "--save-dir", tmp_path / "copy")
    assert "resuming from" not in proc.stdout + proc.stderr
    assert "checkpoint_last.pt (epoch 1 @ 6 updates)" in proc.stdout, proc.stdout[-3000:]
    assert updates(tmp_path / "copy" / "checkpoint_last.pt") == 8


def saved(path, lineage):
    """A checkpoint of the updates `lineage` (fairseq's optimizer history: the save each earlier run
    resumed from, then this one) and no parameters."""
    torch.save({"model": {}, "optimizer_history": [{"num_updates": n} for n in lineage]}, path)


def test_a_run_abandoned_for_an_earlier_checkpoint_is_not_resumed_however_far_it_went(tmp_path):
    """A run that went to update 40, restarted with --restore-file from its update 20 and saved update 30: the
    files of the abandoned run record more updates, and are no part of the run checkpoint_last.pt continues."""
    saved(tmp_path / "checkpoint_1_20.pt", [20])
    saved(tmp_path / "checkpoint_1_40.pt", [40])
    saved(tmp_path / "checkpoint_1_30.pt", [20, 30])
    saved(tmp_path / "checkpoint_last.pt", [20, 30])
    assert checkpoint_to_resume(str(tmp_path)) == (str(tmp_path / "checkpoint_last.pt"), None)
    saved(tmp_path / "checkpoint_1_35.pt", [20, 35])  # the restarted run's next save, its copy cut short
    assert checkpoint_to_resume(str(tmp_path)).path == str(tmp_path / "checkpoint_1_35.pt")
    (tmp_path / "checkpoint_last.pt").unlink()  # which run's, no file says: the most updates
    assert checkpoint_to_resume(str(tmp_path)).path == str(tmp_path / "checkpoint_1_40.pt")


def test_a_truncated_checkpoint_last_alone_is_one_line(cut_short, translation_data, tmp_path):
    last = tmp_path / "checkpoint_last.pt"
    last.write_bytes((cut_short / "checkpoint_last.pt").read_bytes()[:1000])
    proc = run("train", translation_data, *TRANSLATION, "--max-update", 8, "--save-dir", tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == [f"error: {tmp_path} holds checkpoints of an earlier run (checkpoint_last.pt), none "
                                 "of them complete (their saves were cut short), to resume from: to start over, delete "
                                 "them or pass another --save-dir"]
    assert os.listdir(tmp_path) == ["checkpoint_last.pt"]


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import resource, runpy, sys

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # as a full disk: the system refuses the write
sys.argv = ["fairseq-train", *sys.argv[2:]]
runpy.run_module("fairseq_cli.train", run_name="__main__")
"""


@pytest.mark.slow
def test_a_save_the_system_refuses_is_one_line_leaves_no_partial_file_and_the_next_run_resumes(
        killed_run, translation_data, tmp_path):
    """A full disk, or a file-size limit: fairseq retried torch.save into the same file, logged tracebacks
    and left checkpoint_best.pt.tmp, which nothing could load."""
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.endswith(".pt")}
    limit = (tmp_path / "checkpoint_1_6.pt").stat().st_size // 2
    args = [translation_data, *TRANSLATION, "--max-update", 8, "--save-dir", tmp_path, "--user-dir", PLUGIN]
    proc = subprocess.run([sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(limit), *map(str, args)], env=ENV,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert error_lines(proc) == [f"error: could not write {tmp_path / 'checkpoint_last.pt'}: File too large: it would "
                                 "outgrow the largest file this shell lets a process write (ulimit -f): raise the "
                                 "limit; the same command then resumes from the newest complete checkpoint"]
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before  # no .tmp left
    resumed = run("train", *args[:-2]).stdout
    assert "@ 6 updates" in resumed and last_number(r"num_updates (\d+)", resumed) == 8


# ------------------------------------------------- interrupted and concurrent runs

def hold(folder, option, holding):
    """As a run holds its folder: until killed."""
    with held(str(folder), option):
        holding.set()
        time.sleep(600)


@pytest.mark.parametrize("tool", ["train", "generate"])
def test_a_folder_in_use_by_a_running_job_is_refused_until_the_job_ends_however_it_ends(
        cut_short, translation_data, tmp_path, tool):
    """Two runs into one --save-dir (or --results-path) both ended with exit status 0, their checkpoints
    (or results) mixed. The folder is held by a lock the system releases when the holder dies, kill -9 too
    (the holder a process forked from this one)."""
    folder = tmp_path / "shared"
    option = "--save-dir" if tool == "train" else "--results-path"
    args = ([translation_data, *TRANSLATION, "--max-update", 2] if tool == "train" else
            [translation_data, "--path", cut_short / "checkpoint_1_6.pt", "--batch-size", 4])
    fork = multiprocessing.get_context("fork")
    holding = fork.Event()
    holder = fork.Process(target=hold, args=(folder, option, holding))
    holder.start()
    try:
        assert holding.wait(60)
        proc = run(tool, *args, option, folder, check=False)
        assert error_lines(proc) == [f"error: {option} {folder} is in use by another run, which has not ended: wait "
                                     f"for it, or pass another {option}"]
        assert os.listdir(folder) == []
    finally:
        holder.kill()
        holder.join()
    run(tool, *args, option, folder)


INTERRUPTED_AT = """
import importlib, logging, os, runpy, signal, sys

logging.basicConfig(level=logging.INFO, stream=sys.stdout)  # as fairseq's tools log, before fairseq is imported here
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Ctrl-C (a test runner may ignore it)
where, sig, at, tool, *argv = sys.argv[1:]
module, qualified = where.split(":")
owner, method = qualified.split(".")
cls = getattr(importlib.import_module(module), owner)
original, calls = getattr(cls, method), []

def interrupted(*args, **kwargs):
    calls.append(None)
    if len(calls) == int(at):  # as Ctrl-C (SIGINT) or a kill (SIGTERM) would, halfway through the run
        os.kill(os.getpid(), getattr(signal, sig))
    return original(*args, **kwargs)

setattr(cls, method, interrupted)
sys.argv = [f"fairseq-{tool}", *argv]
runpy.run_module(f"fairseq_cli.{tool}", run_name="__main__", alter_sys=True)  # as `python -m` runs it
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("tool", ["train", "generate"])
@pytest.mark.slow
def test_an_interrupted_run_is_one_line_and_leaves_what_was_finished_as_it_was(killed_run, translation_data, tmp_path,
                                                                               tool, sig):
    """Ctrl-C during fairseq-generate --results-path D replaced a complete earlier result with part of a new
    one; Ctrl-C and a kill ended fairseq's tools in a traceback."""
    results = tmp_path / "results"
    if tool == "train":
        shutil.copytree(killed_run, tmp_path / "run")
        args, where = [translation_data, *TRANSLATION, "--max-update", 9, "--save-dir", tmp_path / "run"], \
            "fairseq.trainer:Trainer.train_step"
        before = {name: (tmp_path / "run" / name).read_bytes() for name in os.listdir(tmp_path / "run")}
    else:
        args, where = [translation_data, "--path", killed_run / "checkpoint_1_6.pt", "--batch-size", 2,
                       "--results-path", results], "fairseq.tasks.fairseq_task:FairseqTask.inference_step"
        run("generate", *args)
        before = {"generate-test.txt": (results / "generate-test.txt").read_bytes()}
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_AT, where, sig, "2", tool, *map(str, args), "--user-dir",
                           PLUGIN], env=ENV, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert error_lines(proc) == [{
        "train": "error: interrupted: what the run had finished is kept, and nothing it left looks finished "
                 "(fairseq-train resumes from its newest complete checkpoint when run again)",
        "generate": "error: interrupted: fairseq-generate stopped before it finished, and nothing it left looks "
                    "finished (a --results-path keeps the results it held); rerun the same command, which starts "
                    "over"}[tool]]
    folder = tmp_path / "run" if tool == "train" else results
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == before  # nothing else, no .tmp


@pytest.mark.parametrize("tool", ["fairseq-eval-lm", "fairseq-generate", "fairseq-interactive", "fairseq-validate"])
def test_ctrl_c_in_a_tool_that_trains_nothing_speaks_of_that_tool(monkeypatch, tool):
    """fairseq-generate's and fairseq-eval-lm's one line spoke of fairseq-train resuming."""
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{tool}", "data-bin"])
    line = one_line(KeyboardInterrupt())
    assert line.startswith(f"interrupted: {tool} stopped before it finished") and "fairseq-train" not in line


@pytest.mark.parametrize("what", ["a link to nothing", "a file"])
@pytest.mark.parametrize("tool", ["train", "generate"])
def test_a_destination_that_cannot_be_a_folder_is_one_line_before_any_work(cut_short, translation_data, tmp_path,
                                                                           tool, what):
    folder = tmp_path / "out"
    if what == "a file":
        folder.write_text("mine")
    else:
        os.symlink(tmp_path / "nowhere", folder)
    option = "--save-dir" if tool == "train" else "--results-path"
    args = ([translation_data, *TRANSLATION, "--max-update", 2] if tool == "train" else
            [translation_data, "--path", cut_short / "checkpoint_1_6.pt"])
    proc = run(tool, *args, option, folder, check=False)
    assert error_lines(proc) == [f"error: {option} {folder} is {what}, not a folder: pass a folder"]
    assert "Start iterating" not in proc.stdout and not (tmp_path / "nowhere").exists()


# ------------------------------------------------------------ exact resumption


@pytest.mark.parametrize("task,first_half", [
    ("translation", ["--max-update", 15]),  # stops in the middle of epoch 2
    ("feedback_translation", ["--max-epoch", 1]),  # stops at the end of epoch 1
])
def test_resumed_translation_equals_uninterrupted(translation_data, tmp_path, task, first_half):
    common = [translation_data, *TRANSLATION, "--task", task, "--max-epoch", 3]
    run("train", *common, "--save-dir", tmp_path / "one-go")
    run("train", *common, *first_half, "--save-dir", tmp_path / "resumed")
    log = run("train", *common, "--save-dir", tmp_path / "resumed").stdout
    assert "Loaded checkpoint" in log and last_number(r"num_updates (\d+)", log) == 30
    assert_same_parameters(parameters(tmp_path / "one-go"), parameters(tmp_path / "resumed"))


def test_new_batches_each_epoch_is_the_default_for_feedback_transformers_only():
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def update_epoch_batch_itr(*argv):
        args = options.parse_args_and_arch(options.get_training_parser(), ["data", *argv])
        return convert_namespace_to_omegaconf(args).dataset.update_epoch_batch_itr

    for task in ("translation", "feedback_translation"):
        for arch in ("feedback_transformer", "feedback_transformer_iwslt_de_en", "feedback_transformer_wmt_en_de_big"):
            assert update_epoch_batch_itr("--task", task, "--arch", arch) is True
            assert update_epoch_batch_itr("--task", task, "--arch", arch, "--update-epoch-batch-itr", "False") is False
    assert update_epoch_batch_itr("--arch", "transformer") is False  # fairseq's own models keep fairseq's default


@pytest.fixture(scope="module")
def lm_data(lm_data):
    """The shared corpus's data directory (conftest.py): 7 blocks of 4 streams x 16 tokens per epoch."""
    return lm_data[1]


LM_TRAIN = [*LM_MODEL, *SGD, "--tokens-per-sample", 16]


def test_resumed_lm_at_an_epoch_boundary_equals_uninterrupted(lm_data, tmp_path):
    common = [lm_data, *LM_TRAIN, "--batch-size", 4]
    run("train", *common, "--max-epoch", 2, "--save-dir", tmp_path / "one-go")
    run("train", *common, "--max-epoch", 1, "--save-dir", tmp_path / "resumed")
    log = run("train", *common, "--max-epoch", 2, "--save-dir", tmp_path / "resumed").stdout
    assert "Loaded checkpoint" in log
    assert_same_parameters(parameters(tmp_path / "one-go"), parameters(tmp_path / "resumed"))


# ------------------------------------------------------------ streaming layout


@pytest.fixture(scope="module")
def lm_mid_epoch(lm_data, tmp_path_factory):
    """Stopped after 3 of the 7 blocks of epoch 1, in 4 streams of 16 tokens."""
    save_dir = tmp_path_factory.mktemp("mid-epoch")
    run("train", lm_data, *LM_TRAIN, "--batch-size", 4, "--max-update", 3, "--save-dir", save_dir)
    return save_dir


@pytest.mark.parametrize("layout,now", [
    (["--batch-size", 2], "2 streams of 16-token blocks"),
    (["--batch-size", 4, "--tokens-per-sample", 8], "4 streams of 8-token blocks"),
])
def test_resuming_mid_epoch_in_another_stream_layout_is_one_line(lm_data, lm_mid_epoch, tmp_path, layout, now):
    shutil.copy(lm_mid_epoch / "checkpoint_last.pt", tmp_path)
    proc = run("train", lm_data, *LM_TRAIN, *layout, "--max-update", 6, "--save-dir", tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == [
        "error: the checkpoint stopped 3 blocks into epoch 1 with 4 streams of 16-token blocks; this run would "
        f"continue in {now}, training some tokens twice: resume with --tokens-per-sample 16 and 4 streams "
        "(--batch-size x workers), or pass --reset-dataloader to start the data over at epoch 1"]
    assert updates(tmp_path / "checkpoint_last.pt") == 3  # nothing was trained or written


@pytest.mark.slow
def test_the_same_streams_on_two_workers_resume_and_reset_dataloader_starts_over(lm_data, lm_mid_epoch, tmp_path):
    shutil.copy(lm_mid_epoch / "checkpoint_last.pt", tmp_path / "checkpoint_last.pt")
    log = train_on_two_workers(lm_data, *LM_TRAIN, "--batch-size", 2, "--max-update", 5,
                               "--ddp-backend", "legacy_ddp", "--save-dir", tmp_path)
    assert "@ 3 updates" in log and "in 4 streams of" in log
    state = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
    assert (state["epoch"], state["iterations_in_epoch"]) == (1, 5)

    log = run("train", lm_data, *LM_TRAIN, "--batch-size", 2, "--max-update", 7, "--reset-dataloader",
              "--save-dir", tmp_path).stdout
    state = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
    assert (state["epoch"], state["iterations_in_epoch"]) == (1, 2)


# ------------------------------------------------------------ one-line errors


USER_SCRIPT = """
import fairseq_feedback

open("my-own-missing-file.txt")
"""


@pytest.mark.parametrize("how", ["script", "module"])
@pytest.mark.slow
def test_a_users_program_importing_the_plugin_keeps_its_traceback(tmp_path, how):
    (tmp_path / "mine.py").write_text(USER_SCRIPT)
    command = ["mine.py"] if how == "script" else ["-m", "mine"]
    proc = subprocess.run([sys.executable, *command], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and 'open("my-own-missing-file.txt")' in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("FileNotFoundError: [Errno 2] No such file or directory")


NO_EFFECT = """
import sys

import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary, LanguagePairDataset, TokenBlockDataset, data_utils
from fairseq.distributed import utils as distributed_utils
from fairseq.logging import progress_bar


def state():
    return (sys.excepthook, data_utils.batch_by_size, data_utils.load_indexed_dataset, checkpoint_utils.PathManager,
            checkpoint_utils.load_checkpoint, checkpoint_utils.load_checkpoint_to_cpu, distributed_utils.call_main,
            progress_bar.progress_bar, set(map(str, torch.serialization.get_safe_globals())))


before = state()
from fairseq_feedback.models import FeedbackTransformerModel

assert state() == before, "importing the plugin changed fairseq or torch"
# fairseq's data classes that read numpy 1's np.compat.long, built here on numpy 2
lines, sizes, dictionary = [torch.tensor([4, 5, 2]), torch.tensor([6, 2])], [3, 2], Dictionary()
assert len(TokenBlockDataset(lines, sizes, block_size=None, pad=1, eos=2, break_mode="eos")) == 2
assert LanguagePairDataset(lines, sizes, dictionary, lines, sizes, dictionary, num_buckets=2).buckets
hub = FeedbackTransformerModel.from_pretrained(*sys.argv[1:])
assert state() == before, "loading through the hub left the allowlist changed"
print(hub.translate("s1 s2 s3"))
"""


@pytest.mark.slow
def test_importing_the_plugin_changes_nothing_and_the_hub_still_loads(killed_run, translation_data, tmp_path):
    """A program of one's own that imports the plugin keeps fairseq and torch
    as they were (but for the numpy 2 fix of fairseq's data classes, which it
    can build), and loads a checkpoint through the hub all the same."""
    (tmp_path / "mine.py").write_text(NO_EFFECT)
    proc = subprocess.run([sys.executable, "mine.py", killed_run, "checkpoint_1_3.pt", translation_data],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() and all(word.startswith("t") for word in proc.stdout.split())


PREFETCHING_AT_EXIT = """
import sys

import torch
from fairseq.data import iterators
from fairseq_feedback.fairseq_fixes import patches


class Batches:
    \"\"\"Endless batches, each made by a long call to torch, which releases the GIL.\"\"\"

    def __len__(self):
        return 10 ** 6

    def __iter__(self):
        x = torch.randn(1500, 1500)
        while True:
            x = (x @ x).clamp_(-1, 1)
            yield x[0, 0]


if sys.argv[1] == "fixed":
    patches.apply()  # as fairseq's tools apply them
batches = iterators.BufferedIterator(10 ** 6, Batches())  # never full: always making the next batch
next(batches)
"""


@pytest.mark.parametrize("fixed", [pytest.param(False, id="fairseq as it is", marks=pytest.mark.skipif(
    sys.version_info >= (3, 14), reason="CPython 3.14 leaves such a thread hanging instead")),
                                   pytest.param(True, id="in a tool with the plugin")])
@pytest.mark.slow
def test_a_tool_that_ends_while_fairseq_prefetches_a_batch_exits_as_it_ended(tmp_path, fixed):
    """fairseq prefetches batches in a daemon thread. At the end of
    fairseq-train with CUDA graphs on an H100 the last updates outran it, and
    CPython stopped it inside a call to torch as the interpreter exited,
    which aborted a run that had finished ("terminate called without an
    active exception", exit status 134). Here the thread is always inside
    torch; in a tool the plugin stops it at exit, after its batch."""
    (tmp_path / "prefetching.py").write_text(PREFETCHING_AT_EXIT)
    proc = subprocess.run([sys.executable, "prefetching.py", "fixed" if fixed else "plain"], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=120)
    if fixed:
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert proc.returncode == -6 and "terminate called without an active exception" in proc.stderr


@pytest.mark.parametrize("how", ["console script", "python -m"])
@pytest.mark.slow
def test_fairseq_tools_still_print_the_plugins_errors_as_one_line(tmp_path, how):
    """... and nothing else: not the twenty lines of hydra's deprecation warnings that fairseq's start-up raised
    (Python's warnings shown, as a user's shell shows them)."""
    command = ([os.path.join(os.path.dirname(sys.executable), "fairseq-train")] if how == "console script"
               else [sys.executable, "-m", "fairseq_cli.train"])
    env = {name: value for name, value in ENV.items() if name != "PYTHONWARNINGS"}
    proc = subprocess.run([*command, tmp_path, "--user-dir", PLUGIN, "--arch", "feedback_transformer",
                           "--memory-span", "0"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert error_lines(proc) == ["error: --memory-span must be at least 1, got 0"]
    assert proc.stderr.splitlines() == ["error: --memory-span must be at least 1, got 0"], proc.stderr


# ------------------------------------------------------------ whose exception


A_DEFECT_OF_OURS = """
import math
import sys

sys.argv = ["fairseq-train", *sys.argv[1:]]  # a fairseq tool: the plugin applies its fixes as it is imported
from fairseq_cli.train import cli_main
from fairseq_feedback.tasks import feedback_language_modeling

# this plugin's task fails in its own code, as with a defect: math.sqrt is C, a call with no frame of its own
feedback_language_modeling.SplitStream = math.sqrt
cli_main()
"""


@pytest.mark.slow
def test_a_defect_in_this_plugin_still_shows_its_traceback(lm_data, tmp_path):
    (tmp_path / "defect.py").write_text(A_DEFECT_OF_OURS)
    proc = subprocess.run([sys.executable, tmp_path / "defect.py", lm_data, *map(str, LM_TRAIN), "--batch-size", "4",
                           "--max-update", "1", "--save-dir", tmp_path / "out", "--user-dir", PLUGIN],
                          env=ENV, capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-3000:]
    assert "fairseq_feedback/tasks/feedback_language_modeling.py" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "TypeError: math.sqrt() takes exactly one argument (3 given)"
    assert not (tmp_path / "out").exists()  # the plugin's fixes ran: the --save-dir the run created went


SPAWNED = """
import sys

import torch

if __name__ == "__main__":
    torch.cuda.device_count = lambda: 1  # fairseq spawns a rank per GPU it counts: here one, on the CPU
    from fairseq_cli.train import cli_main

    sys.argv = ["fairseq-train", *sys.argv[1:]]
    cli_main()
"""


@pytest.mark.slow
def test_fairseqs_exception_in_a_rank_it_spawned_is_one_line(lm_data, tmp_path):
    """torch.multiprocessing.spawn gives the parent the rank's traceback as text: the line is the rank's
    exception, as fairseq raised it there (building its trainer)."""
    (tmp_path / "spawned.py").write_text(SPAWNED)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = subprocess.run([sys.executable, tmp_path / "spawned.py", lm_data, *map(str, LM_TRAIN), "--batch-size", "4",
                           "--lr", "0.5,0.1", "--lr-scheduler", "inverse_sqrt", "--distributed-world-size", "1",
                           "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-backend", "gloo",
                           "--save-dir", tmp_path / "out", "--user-dir", PLUGIN],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "error:" in line] == [  # the rank logs to stderr
        "error: ValueError: Cannot use a fixed learning rate schedule with inverse_sqrt. Consider --lr-scheduler=fixed "
        "instead. (in fairseq.optim.lr_scheduler.inverse_square_root_schedule; check --lr-scheduler inverse_sqrt; "
        "for the whole traceback, rerun with FAIRSEQ_FEEDBACK_TRACEBACK=1)"]
    assert not (tmp_path / "out").exists()


def raised_in_a_dataloader_worker(function, item):
    """What the DataLoader re-raises once `function(item)` failed in its worker process."""
    loader = torch.utils.data.DataLoader([item], batch_size=None, num_workers=1, collate_fn=function)
    with pytest.raises(Exception) as raised:
        next(iter(loader))
    return raised.value


def test_what_a_dataloader_worker_raised_is_judged_where_it_was_raised(tmp_path):
    """torch re-raises it in the main process with the worker's traceback as text: fairseq's (a dictionary
    read there) is one line; this plugin's FeedbackUsageError its message; a defect of ours, its traceback."""
    (tmp_path / "dict.txt").write_text("a 1\na 1\n")
    fairseqs = one_line(raised_in_a_dataloader_worker(Dictionary.load, str(tmp_path / "dict.txt")))
    assert fairseqs.startswith("RuntimeError: Duplicate word found when loading Dictionary: 'a'. ")
    assert fairseqs.endswith("(in fairseq.data.dictionary; for the whole traceback, rerun with "
                             "FAIRSEQ_FEEDBACK_TRACEBACK=1)")
    assert one_line(raised_in_a_dataloader_worker(functools.partial(monolingual_split, str(tmp_path)), "nosuch")) \
        == f"split 'nosuch' not found in {tmp_path}: expected nosuch.bin and nosuch.idx from fairseq-preprocess " \
           "--only-source"
    assert one_line(raised_in_a_dataloader_worker(functools.partial(monolingual_split, None), "nosuch")) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="fairseq spawns a rank per GPU")
def test_spawning_ranks_on_a_machine_without_gpus_is_refused(lm_data, tmp_path):
    """fairseq would spawn none, and end with exit status 0, having trained nothing."""
    proc = run("train", lm_data, *LM_TRAIN, "--batch-size", 4, "--distributed-world-size", 2,
               "--distributed-init-method", "tcp://127.0.0.1:1", "--save-dir", tmp_path / "out", check=False)
    assert proc.returncode == 1 and error_lines(proc) == [
        "error: fairseq starts one process per GPU for --distributed-init-method, and torch sees none: on CPUs, start "
        "one process per rank with --distributed-no-spawn --distributed-rank R (and --cpu --distributed-backend "
        "gloo)"]
    assert not (tmp_path / "out").exists()
