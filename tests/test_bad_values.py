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
start `python -m` like a user's shell does, in a new process. The module's
last lines report the counts.
"""

import os
import shutil
import time

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


@pytest.mark.parametrize("name", CASES)
def test_a_bad_value_stops_with_one_line_and_creates_nothing(name, files, tmp_path):
    run_case(CASES[name], files, tmp_path)


# ---------------------------------------------------------------------- the advice works


def test_a_continued_model_may_change_its_regularisation_and_how_it_is_computed(files, tmp_path):
    proc = in_process("train", [a.format(**files, OUT=tmp_path / "out") for a in LM_TRAIN] + [
        "--restore-file", files["LM_CKPT"], "--max-update", "2", "--dropout", "0.3", "--attention-dropout", "0.1",
        "--max-target-positions", "64", "--cuda-graphs", "off"])
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
