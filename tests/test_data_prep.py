"""data_prep scripts, offline, on tiny raw data in each dataset's real format (tests/data_prep_fixtures.py)."""

import contextlib
import dataclasses
import hashlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fairseq.data import Dictionary, data_utils

import data_prep_fixtures as fx
from helpers import run_script, script_error
from fairseq_feedback_cli.data_prep import downloads, steps, text, translation
from fairseq_feedback_cli.data_prep import prepare_cnn_dm as cnn
from fairseq_feedback_cli.data_prep import prepare_iwslt14_de_en as iwslt
from fairseq_feedback_cli.data_prep import prepare_wikitext103 as wiki
from fairseq_feedback_cli.data_prep import prepare_wmt14_en_de as wmt

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("preprocess_in_this_process")


def dirs(tmp_path):
    return ["--dest", tmp_path / "data-bin" / "out", "--work", tmp_path / "work", "--workers", 1]


def boom(*args, **kwargs):
    raise RuntimeError("interrupted")


def loaded_sizes(dest: Path, split: str, pair: str, langs) -> list:
    sizes = []
    for lang in langs:
        d = Dictionary.load(str(dest / f"dict.{lang}.txt"))
        ds = data_utils.load_indexed_dataset(str(dest / f"{split}.{pair}.{lang}"), d)
        assert ds is not None, f"{split}.{pair}.{lang} does not load"
        sizes.append(len(ds))
    return sizes


def check_translation(dest: Path, src: str, tgt: str, counts: dict) -> None:
    assert (dest / f"dict.{src}.txt").read_text() == (dest / f"dict.{tgt}.txt").read_text()  # joined
    for split, n in counts.items():
        assert loaded_sizes(dest, split, f"{src}-{tgt}", (src, tgt)) == [n, n], split


def lines(path: Path) -> list:
    return path.read_text(encoding="utf-8").splitlines()


# ------------------------------------------------------------------ IWSLT14


def test_iwslt_interrupted_resumed_and_rerun(tmp_path, monkeypatch):
    counts = fx.write_iwslt(tmp_path / "raw")
    args = ["--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 300]
    dest, work = tmp_path / "data-bin" / "out", tmp_path / "work"

    monkeypatch.setattr(translation, "learn_bpe", boom)
    with pytest.raises(RuntimeError):
        run_script(iwslt, *args)
    assert not dest.exists() and not (work / "bpe").exists()
    assert (work / "text" / steps.DONE).exists()

    # resumes after the finished text step, which must not run again
    monkeypatch.setattr(translation, "learn_bpe", text.learn_bpe)
    monkeypatch.setattr(iwslt, "tokenize", boom)
    run_script(iwslt, *args)
    check_translation(dest, "de", "en", counts)
    assert (dest / "code").exists()
    train = (work / "text" / "train.en").read_text()
    assert "speaker" not in train and "ted.com" not in train  # the tag lines are gone
    test = (work / "text" / "test.en").read_text()
    assert "it &apos;s " in test and test == test.lower()

    # a rerun has nothing to do: no fairseq-preprocess, nothing rewritten
    before = {f.name: f.stat().st_mtime_ns for f in dest.iterdir()}
    monkeypatch.setattr(steps.subprocess, "run", boom)
    start = time.perf_counter()
    run_script(iwslt, *args)
    assert time.perf_counter() - start < 2
    assert {f.name: f.stat().st_mtime_ns for f in dest.iterdir()} == before

    assert "bpe_merges: 300 -> 100" in script_error(iwslt, *args[:-1], 100)


def test_iwslt_keeps_what_fairseqs_script_keeps_and_counts_it(tmp_path, capsys):
    counts = fx.write_iwslt(tmp_path / "raw")
    run_script(iwslt, "--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 300)
    text = tmp_path / "work" / "text"
    pairs = list(zip(lines(text / "train.de") + lines(text / "valid.de"),
                     lines(text / "train.en") + lines(text / "valid.en")))
    english = [e for _, e in pairs]
    # <title> and <description> keep their text, without the tags
    assert "person 1 : a talk in en" in english
    assert "ted talk subtitles and transcript : talk 2 ( en )" in english
    assert not any("&lt; title" in e or "&lt; speaker" in e or "reviewer" in e or "talkid" in e for e in english)
    # a sentence that begins with "<" is a sentence, and stays beside its translation
    (de, en), = [p for p in pairs if p[1].startswith("&lt; 3 ")]
    assert len(en.split()) == len(de.split()) + 2  # the fixture's pairs have as many words on each side
    check_translation(tmp_path / "data-bin" / "out", "de", "en", counts)
    assert (f"sentence pairs: train {counts['train']}, valid {counts['valid']}, test {counts['test']} "
            "(the official archives give: examples/iwslt14_de_en/README.md)") in capsys.readouterr().err


def test_a_rerun_on_other_raw_files_never_reuses_what_the_old_ones_made(tmp_path):
    raw = tmp_path / "raw"
    fx.write_iwslt(raw)
    args = ["--raw", raw, *dirs(tmp_path), "--bpe-merges", 300]
    dest, text = tmp_path / "data-bin" / "out", tmp_path / "work" / "text"
    run_script(iwslt, *args)
    assert "garden" in (text / "train.en").read_text()

    # the same talks with another word, written over the raw files
    for f in (raw / "de-en").iterdir():
        f.write_text(f.read_text().replace("garden", "orchard").replace("garten", "hof"))
    message = script_error(iwslt, *args)  # the dest was made from the old files: refused, never kept as done
    assert "sources: de-en/IWSLT14.TED.dev2010.de-en.de.xml" in message and "more changed" in message

    shutil.rmtree(dest)
    run_script(iwslt, *args)
    made = (text / "train.en").read_text() + (text / "valid.en").read_text()
    assert "orchard" in made and "garden" not in made
    assert "garden" not in Dictionary.load(str(dest / "dict.en.txt"))


@pytest.fixture
def known_iwslt_archive(tmp_path, monkeypatch):
    """A fixture de-en.tgz that the checksum table takes for the real one."""
    archive = fx.iwslt_archive(tmp_path)
    real = iwslt.ARCHIVES["de-en.tgz"]
    monkeypatch.setitem(iwslt.ARCHIVES, "de-en.tgz", dataclasses.replace(real, checksum=fx.sha256(archive)))
    return archive


def test_iwslt_from_archive(tmp_path, known_iwslt_archive):
    counts = fx.write_iwslt(tmp_path / "unused")
    run_script(iwslt, "--raw", known_iwslt_archive.parent, *dirs(tmp_path), "--bpe-merges", 300)
    check_translation(tmp_path / "data-bin" / "out", "de", "en", counts)
    assert (tmp_path / "work" / "extracted" / "de-en.tgz" / "de-en" / "train.tags.de-en.de").exists()


def test_corrupt_archive_is_caught(tmp_path, known_iwslt_archive):
    data = known_iwslt_archive.read_bytes()
    known_iwslt_archive.write_bytes(data[: len(data) // 2])
    message = script_error(iwslt, "--raw", known_iwslt_archive.parent, *dirs(tmp_path))
    assert str(known_iwslt_archive) in message and "corrupt" in message and "delete it" in message
    assert not (tmp_path / "data-bin" / "out").exists()
    assert not (tmp_path / "work" / "extracted" / "de-en.tgz").exists()


def test_missing_raw_file_is_named(tmp_path):
    fx.write_iwslt(tmp_path / "raw")
    (tmp_path / "raw" / "de-en" / "IWSLT14.TED.tst2011.de-en.en.xml").unlink()
    message = script_error(iwslt, "--raw", tmp_path / "raw", *dirs(tmp_path))
    assert "IWSLT14.TED.tst2011.de-en.en.xml" in message and "de-en.tgz" in message


@pytest.mark.parametrize("bad,message", [
    (b"\xe9t\xe9 ", "line 7: not UTF-8 (byte 0xe9 at byte 1 of the line), and this script reads UTF-8: convert it "
                    "(iconv -t utf-8)"),
    (text.BOM, "line 1: begins with a byte-order mark, which this script would read as part of its first word: "
               "remove it (sed -i '1s/^\\xEF\\xBB\\xBF//' {path})"),
])
def test_raw_text_not_utf8_or_with_a_byte_order_mark_is_one_line(tmp_path, bad, message):
    """The bytes were replaced without a word (exit status 0), and a byte-order mark went on as part of the
    first word. (Read in a Pool: the next test.)"""
    fx.write_iwslt(tmp_path / "raw")
    train = tmp_path / "raw" / "de-en" / "train.tags.de-en.de"
    raw_lines = train.read_bytes().split(b"\n")
    at = 6 if bad != text.BOM else 0
    raw_lines[at] = bad + raw_lines[at]
    train.write_bytes(b"\n".join(raw_lines))
    argv = ["--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 300]
    assert script_error(iwslt, *argv) == f"error: {train}, {message.format(path=train)}"
    assert not (tmp_path / "data-bin" / "out").exists()


def read_all(path):
    return list(text.read_lines(path))


def test_a_failure_to_read_text_in_a_pool_ends_the_command_and_does_not_hang(tmp_path):
    """fail()'s exit, raised in a Pool's worker or in the thread that feeds it, ended them silently and
    left the pool waiting forever: read_lines' exit is an Exception too, which the pool passes on. (A
    thread, so that a pool that waits fails the test after a minute instead of hanging it.)"""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good\nbad \xff\n")
    for items, fn in (([bad], read_all), (text.read_lines(bad), str.upper)):  # in a worker; in the feeding thread
        ended = {}

        def consume():
            try:
                list(text.pmap(fn, items, 2, "read"))
            except SystemExit as e:
                ended["line"] = e.code

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        reader.join(60)
        assert ended.get("line", "").startswith(f"error: {bad}, line 2: not UTF-8 (byte 0xff"), ended


def test_bpe_merges_below_1_is_one_line_before_any_work(tmp_path):
    """subword-nmt learnt 0 merges, then failed on the codes file it wrote."""
    fx.write_iwslt(tmp_path / "raw")
    assert script_error(iwslt, "--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 0) == \
        "error: --bpe-merges must be at least 1, got 0"
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("broken", ["a seg not closed", "a segment more in one language"])
def test_test_sets_that_do_not_pair_up_are_named_and_nothing_is_written(tmp_path, broken):
    """A <seg> without its </seg> gave an empty German line paired with its English reference; a segment
    more on one side would pair every later sentence with the wrong translation."""
    fx.write_iwslt(tmp_path / "raw")
    xml = tmp_path / "raw" / "de-en" / "IWSLT14.TED.tst2010.de-en.de.xml"
    lines = xml.read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if "<seg" in line)
    if broken == "a seg not closed":
        lines[first] = lines[first].replace("</seg>", "")
    else:
        lines.insert(first, '<seg id="0"> Noch ein Satz . </seg>')
    xml.write_text("\n".join(lines) + "\n", encoding="utf-8")
    message = script_error(iwslt, "--raw", tmp_path / "raw", *dirs(tmp_path))
    if broken == "a seg not closed":
        assert f"{xml}, line {first + 1}: not one whole <seg>...</seg>" in message
    else:
        assert ("the test sets do not pair up, segment for segment: IWSLT14.TED.tst2010.de-en.de.xml has "
                in message)
    assert not (tmp_path / "data-bin" / "out").exists()


@pytest.mark.parametrize("how", [["-m", "fairseq_feedback_cli.data_prep.prepare_wikitext103"],
                                 ["fairseq_feedback_cli/data_prep/prepare_iwslt14_de_en.py"]])
@pytest.mark.slow
def test_command_line_error_is_one_line(tmp_path, how):
    (tmp_path / "raw").mkdir()
    proc = subprocess.run([sys.executable, *how, "--raw", str(tmp_path / "raw"), *map(str, dirs(tmp_path))],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "has neither" in proc.stderr


@pytest.mark.parametrize("option,path,message", [
    ("--dest", "/proc/nope/bin", "--dest /proc/nope/bin: nothing can be written in /proc (No such file or directory): "
                                 "pass a path you can write to"),
    ("--dest", "{raw}/wikitext-103/wiki.train.tokens/bin", "{raw}/wikitext-103/wiki.train.tokens is a file, not a folder"),
    ("--work", "/proc/nope/work", "--work /proc/nope/work: nothing can be written in /proc"),
])
def test_an_unwritable_destination_is_one_line_before_any_work(tmp_path, option, path, message):
    fx.write_wikitext(tmp_path / "raw")
    argv = dirs(tmp_path)
    argv[argv.index(option) + 1] = path.format(raw=tmp_path / "raw")
    assert message.format(raw=tmp_path / "raw") in script_error(wiki, "--raw", tmp_path / "raw", *argv)
    assert not (tmp_path / "work").exists() and not (tmp_path / "data-bin").exists()


# a stand-in for fairseq-preprocess, which says who it is and waits to be stopped
SLOW_PREPROCESS = """
import os, time
pid_file = os.environ["PREPROCESS_PID"]
with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pid_file + ".tmp", pid_file)
time.sleep(120)
"""


def running(pid) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet collected, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_sigterm_ends_the_scripts_fairseq_preprocess_and_leaves_no_partial_output(tmp_path):
    """kill (SIGTERM) stops a data script as Ctrl-C does: its fairseq-preprocess
    stops too, no partial folder stays, and it says so in one line."""
    fake = tmp_path / "fake" / "fairseq_cli"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "preprocess.py").write_text(SLOW_PREPROCESS)
    fx.write_wikitext(tmp_path / "raw")
    pid_file = tmp_path / "preprocess.pid"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "fake"), str(REPO)]),
               PREPROCESS_PID=str(pid_file))
    with open(tmp_path / "stderr", "w") as err:
        script = subprocess.Popen([sys.executable, "-m", "fairseq_feedback_cli.data_prep.prepare_wikitext103", "--raw",
                                   tmp_path / "raw", *map(str, dirs(tmp_path))], env=env, stderr=err)
    deadline = time.monotonic() + 60
    while not pid_file.exists():
        assert script.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.05)
    preprocess = int(pid_file.read_text())
    script.send_signal(signal.SIGTERM)
    script.wait(60)
    try:
        assert not running(preprocess)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(preprocess, signal.SIGKILL)
    assert script.returncode == 1
    lines = (tmp_path / "stderr").read_text().strip().splitlines()
    assert lines[-1] == "error: interrupted; rerun the same command to resume", lines
    assert not (tmp_path / "data-bin" / "out").exists() and not (tmp_path / "data-bin" / "out.tmp").exists()


# ------------------------------------------------------------------- WMT14


def test_wmt(tmp_path):
    counts = fx.write_wmt(tmp_path / "raw")
    run_script(wmt, "--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 500, "--workers", 2)  # multiprocess
    check_translation(tmp_path / "data-bin" / "out", "en", "de", counts)
    text = tmp_path / "work" / "text"
    assert "well @-@ known" in (text / "train.en").read_text()  # aggressive hyphen splitting
    assert "gut @-@ bekanntes" in (text / "train.de").read_text()  # – normalized first
    assert "&quot; well" in (text / "train.en").read_text()  # “ normalized, then escaped
    assert lines(text / "test.en")[0].startswith("It &apos;s ")


def test_wmt_takes_news_commentary_v12_and_says_so(tmp_path, capsys):
    raw = tmp_path / "raw"
    counts = fx.write_wmt(raw, news_commentary="v12")  # fairseq's script's default
    run_script(wmt, "--raw", raw, *dirs(tmp_path), "--bpe-merges", 500)
    dest = tmp_path / "data-bin" / "out"
    check_translation(dest, "en", "de", counts)
    assert json.loads((dest / steps.SETTINGS_FILE).read_text())["news_commentary"] == "v12"
    err = capsys.readouterr().err
    assert "News Commentary v12 (training-parallel-nc-v12.tgz" in err
    assert f"sentence pairs: train {counts['train']}, valid {counts['valid']}, test {counts['test']} " in err

    fx.write_wmt(raw)  # v9 beside it: which one is meant?
    assert "--news-commentary" in script_error(wmt, "--raw", raw, *dirs(tmp_path / "both"))
    fx.write_wmt(tmp_path / "v12-only", news_commentary="v12")
    assert "training-parallel-nc-v9.tgz" in script_error(wmt, "--raw", tmp_path / "v12-only", "--news-commentary", "v9",
                                                     *dirs(tmp_path / "v9"))


# ----------------------------------------------------------- CNN-DailyMail


def test_cnn_dm_stories(tmp_path):
    counts = fx.write_cnn_dm(tmp_path / "raw")
    run_script(cnn, "--raw", tmp_path / "raw", *dirs(tmp_path), "--vocab-size", 200)
    dest, work = tmp_path / "data-bin" / "out", tmp_path / "work"
    for split, n in counts.items():
        assert loaded_sizes(dest, split, "source-target", ("source", "target")) == [n, n]
    assert (dest / cnn.SPM_MODEL).exists()
    articles = [a.split() for a in lines(work / "text" / "train.source")]
    assert max(map(len, articles)) == 400 and all(articles)
    assert "a caption without a period." in (work / "text" / "test.source").read_text()

    # the references for ROUGE: detokenized, highlights joined, each with its period
    refs = lines(work / "text" / "test.target")
    assert len(refs) == counts["test"] and all(r.endswith(".") and r.count(". ") >= 1 for r in refs)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(dest / cnn.SPM_MODEL))
    pieces = lines(work / "spm" / "test.target")
    assert [sp.decode(p.split()) for p in pieces] == refs


def test_cnn_dm_line_files(tmp_path):
    counts = fx.write_cnn_dm_lines(tmp_path / "raw")
    run_script(cnn, "--raw", tmp_path / "raw", *dirs(tmp_path), "--vocab-size", 200)
    for split, n in counts.items():
        assert loaded_sizes(tmp_path / "data-bin" / "out", split, "source-target", ("source", "target")) == [n, n]
    assert {len(a.split()) for a in lines(tmp_path / "work" / "text" / "train.source")} == {400}


def test_cnn_dm_counts_what_it_made(tmp_path, capfd):  # capfd: sentencepiece writes to the real stderr
    counts = fx.write_cnn_dm_lines(tmp_path / "raw")
    run_script(cnn, "--raw", tmp_path / "raw", *dirs(tmp_path), "--vocab-size", 200)
    assert (f"article-summary pairs: train {counts['train']}, valid {counts['valid']}, test {counts['test']} "
            "(the official archives give: examples/cnn_dm/README.md)") in capfd.readouterr().err


def test_cnn_dm_too_few_pieces_for_the_text_is_one_line(tmp_path):
    fx.write_cnn_dm_lines(tmp_path / "raw")
    error = script_error(cnn, "--raw", tmp_path / "raw", *dirs(tmp_path), "--vocab-size", 5)
    assert "sentencepiece cannot learn 5 pieces" in error and "Vocabulary size is smaller than required_chars" in error
    assert "--vocab-size" in error and not (tmp_path / "data-bin" / "out").exists()


def test_cnn_dm_missing_files_are_named(tmp_path):
    fx.write_cnn_dm(tmp_path / "raw")
    (tmp_path / "raw" / "url_lists" / "all_val.txt").unlink()
    assert "all_val.txt" in script_error(cnn, "--raw", tmp_path / "raw", *dirs(tmp_path))
    fx.write(tmp_path / "lines" / "train.source", ["an article"])
    assert "train.target" in script_error(cnn, "--raw", tmp_path / "lines", *dirs(tmp_path))


# --------------------------------------------------- a local download server


class _Server(http.server.BaseHTTPRequestHandler):
    """Serves `payload` at any path, honouring `Range: bytes=N-`; records the ranges asked for."""

    payload = b""
    ranges: list = []

    def do_GET(self):
        if self.path.startswith("/missing"):
            self.send_error(404)
            return
        asked = self.headers.get("Range")
        self.ranges.append(asked)
        start = int(asked.split("=")[1].rstrip("-")) if asked else 0
        self.send_response(206 if asked else 200)
        if asked:
            self.send_header("Content-Range", f"bytes {start}-{len(self.payload) - 1}/{len(self.payload)}")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(self.payload) - start))
        self.end_headers()
        self.wfile.write(self.payload[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    _Server.payload = os.urandom(300_000)
    _Server.ranges = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


# ---------------------------------------------------------------- WikiText


def test_wikitext_downloaded(tmp_path, monkeypatch, server):
    archive = fx.wikitext_archive(tmp_path)
    counts = fx.write_wikitext(tmp_path / "unused")
    _Server.payload = archive.read_bytes()
    known = dataclasses.replace(wiki.ARCHIVES[archive.name], urls=(f"{server}/{archive.name}",),
                                checksum=fx.sha256(archive))
    monkeypatch.setitem(wiki.ARCHIVES, archive.name, known)
    args = dirs(tmp_path)
    dest = tmp_path / "data-bin" / "out"

    def preprocess_dies_half_way(cmd, stdout, **kwargs):  # as on a full disk
        out = Path(cmd[cmd.index("--destdir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "train.bin").write_bytes(b"half")
        stdout.write("Traceback (most recent call last):\n  ...\nOSError: [Errno 28] No space left on device\n")
        return subprocess.CompletedProcess(cmd, 1)

    with monkeypatch.context() as m:
        m.setattr(steps.subprocess, "run", preprocess_dies_half_way)
        log = tmp_path / "work" / "fairseq-preprocess.log"
        assert script_error(wiki, *args) == ("error: fairseq-preprocess failed with exit status 1: OSError: [Errno 28] "
                                             f"No space left on device (its whole log: {log})")
    assert not dest.exists() and "Traceback" in log.read_text()  # on the screen, the one line
    assert (tmp_path / "work" / "downloads" / archive.name).read_bytes() == _Server.payload

    # the rerun neither downloads nor extracts again
    monkeypatch.setattr(downloads, "extract", boom)
    run_script(wiki, *args)
    d = Dictionary.load(str(dest / "dict.txt"))
    for split, n in counts.items():
        assert len(data_utils.load_indexed_dataset(str(dest / split), d)) == n
    assert "known" in d and "@-@" in d and d.index("<unk>") == d.unk()
    assert not (dest.parent / "out.tmp").exists() and _Server.ranges == [None]


def test_wikitext_counts_lines_and_tokens_as_fairseq(tmp_path, capsys):
    counts = fx.write_wikitext(tmp_path / "raw")
    run_script(wiki, "--raw", tmp_path / "raw", *dirs(tmp_path))
    tokens = {split: sum(len(line.split()) + 1 for line in lines(tmp_path / "raw" / "wikitext-103" /
                                                                 f"wiki.{split}.tokens"))
              for split in counts}
    d = Dictionary.load(str(tmp_path / "data-bin" / "out" / "dict.txt"))
    datasets = {split: data_utils.load_indexed_dataset(str(tmp_path / "data-bin" / "out" / split), d)
                for split in counts}
    binarized = {split: int(dataset.sizes.sum()) for split, dataset in datasets.items()}
    assert binarized == tokens  # fairseq's count: what fairseq-eval-lm reports as evaluated tokens
    err = capsys.readouterr().err
    assert f"lines: train {counts['train']:,}, valid {counts['valid']:,}, test {counts['test']:,}" in err
    assert f"tokens: train {tokens['train']:,}, valid {tokens['valid']:,}, test {tokens['test']:,}" in err


def test_wikitext_with_a_byte_order_mark_is_one_line(tmp_path):
    """fairseq-preprocess reads WikiText-103's files as they are, and made the mark a word of dict.txt."""
    fx.write_wikitext(tmp_path / "raw")
    train = tmp_path / "raw" / "wikitext-103" / "wiki.train.tokens"
    train.write_bytes(text.BOM + train.read_bytes())
    assert script_error(wiki, "--raw", tmp_path / "raw", *dirs(tmp_path)) == (
        f"error: {train}, line 1: begins with a byte-order mark, which fairseq-preprocess would read as part of its "
        f"first word: check the raw files it is made from, or remove it (sed -i '1s/^\\xEF\\xBB\\xBF//' {train})")
    assert not (tmp_path / "data-bin" / "out").exists()


def test_wikitext_missing_file_is_named(tmp_path):
    fx.write_wikitext(tmp_path / "raw")
    (tmp_path / "raw" / "wikitext-103" / "wiki.valid.tokens").unlink()
    assert "wiki.valid.tokens" in script_error(wiki, "--raw", tmp_path / "raw", *dirs(tmp_path))



# ---------------------------------------------------------------- download


def test_download_resumes_and_verifies(tmp_path, server):
    good = "md5:" + hashlib.md5(_Server.payload).hexdigest()
    archive = downloads.Archive("a.tgz", (f"{server}/missing", f"{server}/a.tgz"), good, ("x",))
    (tmp_path / "a.tgz.part").write_bytes(_Server.payload[:1000])  # left by an interrupted run
    path = downloads.download(archive, tmp_path)
    assert path.read_bytes() == _Server.payload and _Server.ranges == ["bytes=1000-"]
    assert not (tmp_path / "a.tgz.part").exists()
    assert downloads.download(archive, tmp_path) == path and len(_Server.ranges) == 1  # there already

    bad = dataclasses.replace(archive, filename="b.tgz", checksum="md5:" + "0" * 32)
    with pytest.raises(SystemExit, match="downloaded b.tgz is corrupt.*rerun"):
        downloads.download(bad, tmp_path)
    assert not (tmp_path / "b.tgz").exists() and not (tmp_path / "b.tgz.part").exists()

    gone = dataclasses.replace(archive, filename="c.tgz", urls=(f"{server}/missing",))
    with pytest.raises(SystemExit, match="could not download c.tgz .*404.*--raw"):
        downloads.download(gone, tmp_path)
