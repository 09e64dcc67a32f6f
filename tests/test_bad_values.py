"""Every value that cannot work ends with one line naming the fix, before any
directory is created (issue 12, item 6; issue 38: half precision on the CPU,
data files cut short, checkpoints that would run code, models continued with
other options or another objective, destinations that cannot be written):
one sweep through the real tools.

Each case (tests/bad_values_cases.py) is a command line and a fragment of the
message it must stop with. The check is the same for all: a non-zero exit
status, exactly one `error:` line, no traceback, no output path (--save-dir,
--output, --out, --results-path) created, and no checkpoint's code run. Most
run the tool's own function on the command line in this process (a mistake
the plugin names printed as its exception hook prints it); those marked cold
start `python -m` like a user's shell does, in a new process (marked slow:
`make test-slow` runs them). The module's last lines report the counts.
"""

import contextlib
import logging
import os
import shutil
import time

import data_prep_fixtures
import pytest
import torch
from bad_values_cases import CASES, EVAL_LM, GENERATE, LM_TRAIN, TR_TRAIN
from helpers import PLUGIN, run, run_as_a_user, run_module, tiny_lm

# ---------------------------------------------------------------------- the data


def in_process(tool, argv, stdin=""):
    if tool.startswith("fairseq_feedback_cli."):
        return run_module(tool, *argv, stdin=stdin, check=False)
    return run(tool, *argv, stdin=stdin, check=False)


def cold(tool, argv, stdin=""):
    """The tool on argv as a user runs it: `python -m`, importing everything."""
    if tool.startswith("fairseq_feedback_cli."):
        return run_as_a_user(tool, *argv, stdin=stdin)
    return run_as_a_user(f"fairseq_cli.{tool}", *argv, "--user-dir", PLUGIN, stdin=stdin)


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Binarized data, its broken variants and checkpoints, by placeholder."""
    root = tmp_path_factory.mktemp("bad_values")
    raw = root / "raw"
    raw.mkdir()
    words = [" ".join(f"s{(i * 5 + j) % 12}" for j in range(3 + i % 5)) for i in range(40)]
    for split, lines in (("train", words[:30]), ("valid", words[30:35]), ("test", words[35:])):
        write_lines(raw / f"{split}.src", lines)
        write_lines(raw / f"{split}.tgt", [line.replace("s", "t") for line in lines])
        write_lines(raw / f"{split}.labels", [" ".join("_" if i % 2 else "x" for i, _ in enumerate(line.split()))
                                              for line in lines])
    write_lines(raw / "empty.src", [])
    (raw / "empty.tgt").write_text("")
    f = {name: root / name.lower() for name in ("LM", "TR", "LM_EMPTY", "TR_EMPTY")}

    def monolingual(train, valid, test, dest, *extra):
        ok(in_process("preprocess", ["--only-source", "--trainpref", raw / train, "--validpref", raw / valid,
                                         "--testpref", raw / test, "--destdir", dest, "--workers", 1, *extra]))

    monolingual("train.src", "valid.src", "test.src", f["LM"])
    monolingual("train.labels", "valid.labels", "test.labels", f["LM"] / "labels")
    monolingual("empty.src", "valid.src", "empty.src", f["LM_EMPTY"], "--srcdict", f["LM"] / "dict.txt")
    bilingual = ["--source-lang", "src", "--target-lang", "tgt", "--workers", 1]
    ok(in_process("preprocess", [*bilingual, "--trainpref", raw / "train", "--validpref", raw / "valid",
                                     "--testpref", raw / "test", "--joined-dictionary", "--destdir", f["TR"]]))
    ok(in_process("preprocess", [*bilingual, "--trainpref", raw / "empty", "--validpref", raw / "valid",
                                     "--testpref", raw / "empty", "--srcdict", f["TR"] / "dict.src.txt",
                                     "--tgtdict", f["TR"] / "dict.tgt.txt", "--destdir", f["TR_EMPTY"]]))
    for name, data, drop in (("LM_NO_VALID", "LM", "valid."), ("TR_NO_VALID", "TR", "valid."),
                             ("LM_NO_VALID_LABELS", "LM", "labels/valid.")):
        f[name] = root / name.lower()
        shutil.copytree(f[data], f[name])
        for path in f[name].glob(drop + "*"):
            path.unlink()
    f["LM_MISALIGNED"] = root / "lm_misaligned"
    shutil.copytree(f["LM"], f["LM_MISALIGNED"])
    for path in (f["LM_MISALIGNED"] / "labels").glob("valid.*"):
        path.unlink()
    ok(in_process("preprocess", ["--only-source", "--validpref", raw / "train.labels", "--srcdict",
                                 f["LM"] / "labels" / "dict.txt", "--destdir", f["LM_MISALIGNED"] / "labels"]))
    for name, argv in (("LM_CKPT", LM_TRAIN), ("TR_CKPT", TR_TRAIN), ("LABELS_CKPT", [*LM_TRAIN, "--labels", "labels"])):
        save = root / name.lower()
        ok(in_process("train", [a.format(**f, OUT=save) for a in argv]))
        f[name] = save / "checkpoint_last.pt"
    f["TRUNCATED"], f["EMPTY_FILE"], f["TEXT_FILE"] = root / "truncated.pt", root / "empty.pt", root / "text.pt"
    f["TRUNCATED"].write_bytes(f["TR_CKPT"].read_bytes()[:20000])
    f["EMPTY_FILE"].write_bytes(b"")
    f["TEXT_FILE"].write_text("not a checkpoint\n")
    f["EVIL"], f["RAN"] = root / "evil.pt", root / "a checkpoint ran its code"
    torch.save({"model": {}, "payload": RunsCode(f["RAN"])}, f["EVIL"])
    for name, data, file, malformed in (
            ("LM_WORD_TWICE", "LM", "dict.txt", lambda text: text + text.split()[0] + " 1\n"),
            ("TR_WORD_TWICE", "TR", "dict.tgt.txt", lambda text: text + text.split()[0] + " 1\n"),
            ("LM_LABELS_WORD_TWICE", "LM", "labels/dict.txt", lambda text: text + text.split()[0] + " 1\n"),
            ("LM_NO_COUNT", "LM", "dict.txt", lambda text: text.replace(" ", "\n", 1)),
            ("LM_SHORT_DICT", "LM", "dict.txt", lambda text: "".join(text.splitlines(True)[:2])),
            ("LM_NOT_AN_INDEX", "LM", "test.idx", lambda text: "not an index\n")):
        f[name] = root / name.lower()
        shutil.copytree(f[data], f[name])
        (f[name] / file).write_text(malformed((f[name] / file).read_text(errors="replace")))
    f["NO_MODEL"], f["NOT_UTF8"] = root / "no_model.pt", root / "not_utf8.txt"
    torch.save({"cfg": {}}, f["NO_MODEL"])
    f["NOT_UTF8"].write_bytes(b"\xff\xfe s1\n")
    for name, data, cut in (("LM_CUT", "LM", ("test.bin", "train.idx")), ("TR_CUT", "TR", ("test.src-tgt.src.bin",))):
        f[name] = root / name.lower()
        shutil.copytree(f[data], f[name])
        for path in cut:
            (f[name] / path).write_bytes((f[name] / path).read_bytes()[:-10])
    f["TEST_BYTES"] = (f["LM"] / "test.bin").stat().st_size
    f["CUT_BYTES"] = f["TEST_BYTES"] - 10
    f.update(issue_54_files(root, f))
    return f


class RunsCode:
    """Unpickled, it would create a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch '{self.path}'",)


# ---------------------------------------------------------------------- the sweep

TALLY = {"tried": 0, "one line": 0, "seconds": 0.0}


@pytest.fixture(scope="module", autouse=True)
def report(request):
    """The counts, printed after the module's tests (past pytest's capture)."""
    yield
    if TALLY["tried"]:
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\nbad values: {TALLY['tried']} cases tried in {TALLY['seconds']:.0f}s, {TALLY['one line']} "
                  "stopped with one error line and created nothing")


def run_case(case, files, tmp_path):
    names = {key: str(value) for key, value in files.items()}
    names["OUT"] = str(tmp_path / "out")
    argv = [a.format(**names) for a in case.argv]
    start = time.monotonic()
    proc = cold(case.tool, argv, case.stdin) if case.cold else in_process(case.tool, argv, case.stdin)
    TALLY["tried"] += 1
    TALLY["seconds"] += time.monotonic() - start
    printed = proc.stdout + proc.stderr
    errors = [line for line in printed.splitlines() if "error:" in line]
    assert proc.returncode != 0, printed[-3000:]
    assert "Traceback" not in printed, printed[-3000:]
    assert len(errors) == 1, printed[-3000:]
    assert case.message.format(**names) in errors[0], errors[0]
    assert not [p for p in tmp_path.iterdir()], f"created: {sorted(os.listdir(tmp_path))}"
    assert not files["RAN"].exists()
    TALLY["one line"] += 1


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if case.cold else name
                                  for name, case in CASES.items()])
def test_a_bad_value_stops_with_one_line_and_creates_nothing(name, files, tmp_path):
    run_case(CASES[name], files, tmp_path)


# ---------------------------------------------------------------------- the advice works


def test_a_continued_model_may_change_its_regularisation_and_how_it_is_computed(files, tmp_path):
    proc = in_process("train", [a.format(**files, OUT=tmp_path / "out") for a in LM_TRAIN] + [
        "--restore-file", files["LM_CKPT"], "--max-update", "2", "--dropout", "0.3", "--attention-dropout", "0.1",
        "--max-target-positions", "64", "--cuda-graphs", "off"])
    ok(proc)
    assert "Loaded checkpoint" in proc.stdout


def test_a_continued_model_may_change_its_arch_where_that_makes_the_same_model(files, tmp_path):
    """feedback_lm_toy's sizes, given on the command line, make the model feedback_lm made: it differed in
    --base-shuffle alone, which only BASE layers read (which the feedback decoder refuses), and was refused."""
    proc = in_process("train", [a.format(**files, OUT=tmp_path / "out") for a in LM_TRAIN] + [
        "--restore-file", files["LM_CKPT"], "--max-update", "2", "--arch", "feedback_lm_toy"])
    ok(proc)
    assert "Loaded checkpoint" in proc.stdout


def test_the_half_precision_advice_works_on_the_cpu(files, tmp_path):
    """--fp16 trains on the CPU with --fp16-no-flatten-grads, and fairseq-eval-lm scores in float16 there."""
    train = in_process("train", [a.format(**files, OUT=tmp_path / "out") for a in LM_TRAIN] + [
        "--fp16", "--fp16-no-flatten-grads"])
    ok(train)
    assert "loss_scale" in train.stdout + train.stderr
    scored = in_process("eval_lm", [a.format(**files) for a in EVAL_LM] + ["--fp16"])
    ok(scored)
    assert "Perplexity" in scored.stdout + scored.stderr


def test_the_head_dim_advice_works_for_the_language_model():
    """--head-dim lets the language model's heads not divide its dimension."""
    model, _ = tiny_lm("--decoder-attention-heads", "3", "--head-dim", "8")
    tokens = torch.randint(4, 24, (2, 7))
    assert model(tokens)[0].shape == (2, 7, 24)


# ---------------------------------------------------------------------- what fairseq raises, whole


def test_the_whole_traceback_is_one_variable_away(files, monkeypatch):
    """FAIRSEQ_FEEDBACK_TRACEBACK, which the line of fairseq's exception names, gives its traceback back."""
    monkeypatch.setenv("FAIRSEQ_FEEDBACK_TRACEBACK", "1")
    with pytest.raises(AssertionError, match="--sampling requires --nbest to be equal to --beam"):
        in_process("generate", [a.format(**files) for a in GENERATE] + ["--beam", "2", "--sampling"])


def test_a_failed_generate_removes_the_results_file_it_wrote_and_only_that(files, tmp_path):
    """In a --results-path that was there before: the file fairseq-generate opened for a run that failed
    at its first batch goes; one it never opened (a run refused before) stays as it was."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("mine\n")
    argv = [a.format(**files) for a in GENERATE] + ["--results-path", results]
    failed = in_process("generate", [*argv, "--constraints"])
    assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert sorted(os.listdir(results)) == ["notes.txt"]
    (results / "generate-test.txt").write_text("an earlier run's\n")
    assert in_process("generate", [*argv, "--beam", "0"]).returncode != 0
    assert (results / "generate-test.txt").read_text() == "an earlier run's\n"


def test_a_full_disk_under_the_results_is_one_line_naming_results_path(files, tmp_path, monkeypatch):
    """fairseq-generate's print() to its results file, refused as a full disk refuses it (the file opened
    on /dev/full, which refuses every write so): `OSError: [Errno 28] No space left on device (in
    fairseq_cli.generate ...)`, naming neither the results nor a fix."""
    import fairseq_cli.generate

    monkeypatch.setattr(fairseq_cli.generate, "open", lambda *args, **kwargs: open("/dev/full", "w", buffering=1),
                        raising=False)
    results = tmp_path / "results"
    proc = in_process("generate", [a.format(**files) for a in GENERATE] + ["--results-path", results])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "error:" in line] == [
        f"error: --results-path {results}: could not write its results: No space left on device: free some space, "
        "or pass a path on another disk"]
    assert not results.exists()  # the folder the run made, and nothing in it


def test_a_full_disk_under_the_log_file_is_one_warning_and_the_run_goes_on(files, tmp_path, monkeypatch):
    """/dev/full refuses every write, as a full disk does: Python's logging printed a traceback for each line
    fairseq-train logged ("--- Logging error ---", 187 in a short run)."""
    from fairseq.logging import progress_bar

    from fairseq_feedback.fairseq_fixes import runs

    monkeypatch.setattr(runs.LOG_FILE_HANDLERS, "refused", set())  # the files warned of in this process
    loggers = (logging.getLogger("fairseq_cli.train"), progress_bar.logger)
    try:
        proc = in_process("train", [a.format(**files, OUT=tmp_path / "out") for a in LM_TRAIN]
                          + ["--log-file", "/dev/full", "--max-update", "2"])
    finally:  # fairseq's handlers outlive its main
        for log in loggers:
            for handler in [h for h in log.handlers if getattr(h, "baseFilename", None) == "/dev/full"]:
                log.removeHandler(handler)
                with contextlib.suppress(OSError):  # what it holds is refused again as it closes
                    handler.close()
    ok(proc)
    assert "Logging error" not in proc.stderr, proc.stderr[-3000:]
    assert [line.split(" | ")[-1] for line in proc.stdout.splitlines() if "--log-file /dev/full" in line] == [
        "--log-file /dev/full: No space left on device: free some space, or pass a path on another disk; the run "
        "goes on, its log no longer written there"]
    assert "done training" in proc.stdout and (tmp_path / "out" / "checkpoint_last.pt").exists()


# ---------------------------------------------------------------------- issue 54: what is read, and said


def test_an_override_that_keeps_the_parameters_shapes_is_read_and_said(files):
    """Decoding with another span than the model was trained with is an experiment, not a mistake: the
    translation model's decoder has no relative positions, so its parameters fit a model of span 4."""
    proc = in_process("generate", [a.format(**files) for a in GENERATE]
                      + ["--model-overrides", "{'memory_span': 4}", "--max-len-b", "3"])
    ok(proc)
    assert f"{files['TR_CKPT']} was trained with memory_span 8 and is read with memory_span 4 (--model-overrides): " \
           "its parameters fit" in proc.stdout, proc.stdout[-3000:]
    assert "BLEU" in proc.stdout


def test_generate_translates_the_shard_it_is_given(files):
    """fairseq-generate --num-shards 2 --shard-id 1 translated the whole test split, as shard 0 did."""
    proc = in_process("generate", [a.format(**files) for a in GENERATE]
                      + ["--num-shards", "2", "--shard-id", "1", "--max-len-b", "3", "--batch-size", "2"])
    ok(proc)
    ids = {int(line.split("\t")[0][2:]) for line in proc.stdout.splitlines() if line.startswith("S-")}
    assert ids and ids < set(range(5)), ids  # fairseq's ShardedIterator deals the batches to the shards


def issue_54_files(root, f):
    """Files given as checkpoints that are none, and raw data that the data scripts cannot binarize, by
    placeholder."""
    import pickle
    import zipfile

    import numpy as np

    made = {name: root / f"{name.lower()}.pt" for name in ("ZIP", "PICKLE", "TENSOR")}
    with zipfile.ZipFile(made["ZIP"], "w") as archive:  # torch's reader: "file in archive is not in a subdirectory"
        archive.writestr("notes.txt", "results\n")
        archive.writestr("weights.npy", np.zeros(3).tobytes())
    made["PICKLE"].write_bytes(pickle.dumps([1, 2, 3]))  # torch's reader: "Invalid magic number; corrupt file?"
    torch.save(torch.zeros(3), made["TENSOR"])
    made["TAR_GZ"] = root / "model.tar.gz"
    shutil.make_archive(str(root / "model.tar"), "gztar", root_dir=f["LM_CKPT"].parent)
    shutil.move(root / "model.tar.tar.gz", made["TAR_GZ"])
    made["TR_CKPT_DIR"] = f["TR_CKPT"].parent
    made["TEXT_SAVE_DIR"] = root / "text_save_dir"
    made["TEXT_SAVE_DIR"].mkdir()
    shutil.copyfile(f["TEXT_FILE"], made["TEXT_SAVE_DIR"] / "checkpoint_best.pt")
    made["WORK"] = root / "work"  # the data scripts' --work: kept, as they keep it
    made["IWSLT_EMPTY_TRAIN"] = root / "iwslt_empty_train"
    data_prep_fixtures.write_iwslt(made["IWSLT_EMPTY_TRAIN"])
    for lang in ("de", "en"):
        (made["IWSLT_EMPTY_TRAIN"] / "de-en" / f"train.tags.de-en.{lang}").write_text("")
    # line 4 of the train file begins with a latin-1 byte
    latin_1 = b"\xe9t\xe9"
    for name, split, text in (("WIKI_NOT_UTF8", "train", lambda t: t.replace(b"\n", b"\n" + latin_1, 3)
                                                                     .replace(latin_1, b"", 2)),
                              ("WIKI_EMPTY_VALID", "valid", lambda t: b""),
                              ("WIKI_BLANK_TEST", "test", lambda t: b" \n\n \n")):
        made[name] = root / name.lower()
        data_prep_fixtures.write_wikitext(made[name])
        path = made[name] / "wikitext-103" / f"wiki.{split}.tokens"
        path.write_bytes(text(path.read_bytes()))
    return made


def test_the_hub_names_a_file_that_is_no_checkpoint(files):
    """The Python API raises, as a caller expects, with the line the tools print."""
    from fairseq_feedback.errors import FeedbackUsageError
    from fairseq_feedback.models import FeedbackLanguageModel

    with pytest.raises(FeedbackUsageError, match=r"zip\.pt is a zip archive of something else than a checkpoint"):
        FeedbackLanguageModel.from_pretrained(str(files["ZIP"].parent), "zip.pt", data_name_or_path=str(files["LM"]))


def test_a_checkpoint_in_torchs_format_from_before_1_6_still_loads(files, tmp_path):
    """The reader tells torch's older format (a pickle that starts with torch's magic number) from a pickle of
    anything else."""
    from fairseq_feedback import checkpoint_files
    from fairseq_feedback.safe_checkpoints import fairseq_checkpoints_allowed

    legacy = tmp_path / "legacy.pt"
    with fairseq_checkpoints_allowed():
        state = torch.load(files["LM_CKPT"])
        torch.save(state, legacy, _use_new_zipfile_serialization=False)
    assert checkpoint_files.read(legacy)["model"].keys() == state["model"].keys()


def test_a_torchscript_model_is_named_not_handed_to_torch_jit(tmp_path):
    """torch.load hands a TorchScript archive to torch.jit.load, which builds the module it holds."""
    from fairseq_feedback import checkpoint_files
    from fairseq_feedback.errors import FeedbackUsageError

    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "scripted.pt")
    with pytest.raises(FeedbackUsageError, match=r"scripted\.pt is a TorchScript model \(torch\.jit\.save\), not a "
                                                 "checkpoint"):
        checkpoint_files.read(tmp_path / "scripted.pt")
