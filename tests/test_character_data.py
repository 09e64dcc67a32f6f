"""Character-level data (enwik8, char-PTB, the Debian manuals as bytes) on tiny
files in the real formats (tests/data_prep_fixtures.py), and the bits per
byte or character that fairseq-train and fairseq-eval-lm report on them."""

import dataclasses
import json
import re
import shutil

import pytest
from fairseq.data import Dictionary, data_utils

import data_prep_fixtures as fx
from helpers import LM_MODEL, run, run_script, script_error
from fairseq_feedback_cli.data_prep import prepare_char_ptb as char_ptb
from fairseq_feedback_cli.data_prep import prepare_debian_docs as docs
from fairseq_feedback_cli.data_prep import prepare_enwik8 as enwik8

pytestmark = pytest.mark.usefixtures("preprocess_in_this_process")
SPLITS = ("train", "valid", "test")
NEWLINE = b"\n"


def dirs(tmp_path):
    return ["--dest", tmp_path / "data-bin" / "out", "--work", tmp_path / "work", "--workers", 1]


def symbols(dest, split):
    """A binarized split as its dictionary's symbols, the end of a line as "\\n"."""
    d = Dictionary.load(str(dest / "dict.txt"))
    dataset = data_utils.load_indexed_dataset(str(dest / split), d)
    return [d[t] if t != d.eos() else "\n" for i in range(len(dataset)) for t in dataset[i].tolist()], d


def as_bytes(tokens):
    return b"".join(b"\n" if t == "\n" else bytes([int(t)]) for t in tokens)


@pytest.fixture
def small_enwik8(tmp_path, monkeypatch):
    """The fixture's enwik8.zip as the known archive, split as enwik8's last 10M bytes, scaled down."""
    archive = fx.enwik8_archive(tmp_path)
    monkeypatch.setitem(enwik8.ARCHIVES, "enwik8.zip",
                        dataclasses.replace(enwik8.ARCHIVES["enwik8.zip"], checksum=fx.sha256(archive)))
    data = (tmp_path / "src" / "enwik8").read_bytes()
    monkeypatch.setattr(enwik8, "BYTES", len(data))
    monkeypatch.setattr(enwik8, "HELD_OUT", {"valid": 500, "test": 400})
    return archive.parent, data


def test_enwik8_is_one_token_per_byte_split_as_published(tmp_path, small_enwik8, capsys):
    raw, data = small_enwik8
    run_script(enwik8, "--raw", raw, *dirs(tmp_path))
    dest = tmp_path / "data-bin" / "out"
    expected = {"train": data[:-900], "valid": data[-900:-400], "test": data[-400:]}
    for split in SPLITS:
        tokens, d = symbols(dest, split)
        # every byte a token, a newline the end of a line; a last line without one gets one (fairseq's)
        assert as_bytes(tokens) == expected[split] + (b"" if expected[split].endswith(b"\n") else b"\n")
        assert d.unk_word not in tokens
    assert len(d) == d.nspecial + 255  # every byte but the newline, which is the end-of-line token
    settings = json.loads((dest / "data_prep.json").read_text())
    assert settings["unit"] == "byte" and settings["newlines"] is True
    newlines = ", ".join(f"{expected[split].count(NEWLINE):,}" for split in SPLITS)
    assert (f"bytes: train {len(data) - 900:,}, valid 500, test 400, each newline a token ({newlines}): not the "
            "convention of the published numbers") in capsys.readouterr().err


def test_enwik8_without_newlines_is_the_stream_of_its_other_bytes_as_published(tmp_path, small_enwik8, capsys):
    """--no-newlines: as Transformer-XL's loader and the authors' code read it, every byte but the newlines, one
    after another, no end-of-line token anywhere."""
    raw, data = small_enwik8
    run_script(enwik8, "--raw", raw, *dirs(tmp_path), "--no-newlines")
    dest = tmp_path / "data-bin" / "out"
    expected = {"train": data[:-900], "valid": data[-900:-400], "test": data[-400:]}
    for split in SPLITS:
        assert as_bytes(symbols(dest, split)[0]) == expected[split].replace(b"\n", b"")
    assert json.loads((dest / "data_prep.json").read_text())["newlines"] is False
    newlines = ", ".join(f"{expected[split].count(NEWLINE):,}" for split in SPLITS)
    assert f"without their newlines ({newlines}): the convention of the published numbers" in capsys.readouterr().err


def test_enwik8_of_another_size_is_one_line_and_writes_nothing(tmp_path, small_enwik8):
    raw, data = small_enwik8
    (raw / "enwik8.zip").unlink()
    (raw / "enwik8").write_bytes(data[:-1])  # cut short, extracted by hand
    assert script_error(enwik8, "--raw", raw, *dirs(tmp_path)) == (
        f"error: {raw / 'enwik8'} holds {len(data) - 1:,} bytes, not the {len(data):,} of enwik8: "
        "is it the file of enwik8.zip?")
    assert not (tmp_path / "data-bin").exists()


@pytest.fixture
def small_char_ptb(tmp_path, monkeypatch):
    archive = fx.char_ptb_archive(tmp_path)
    monkeypatch.setitem(char_ptb.ARCHIVES, "simple-examples.tgz",
                        dataclasses.replace(char_ptb.ARCHIVES["simple-examples.tgz"], checksum=fx.sha256(archive)))
    lines = fx.write_char_ptb(tmp_path / "unused")
    tokens = {s: sum(len(line.split()) + 1 for line in lines[s]) for s in SPLITS}
    monkeypatch.setattr(char_ptb, "PUBLISHED", {"lines": {s: len(lines[s]) for s in SPLITS},
                                                "tokens": {s: (round(n, -1), 10) for s, n in tokens.items()}})
    return archive.parent, lines, tokens


def test_char_ptb_is_its_characters_with_every_symbol_in_the_dictionary(tmp_path, small_char_ptb, capsys):
    raw, lines, tokens = small_char_ptb
    run_script(char_ptb, "--raw", raw, *dirs(tmp_path))
    dest = tmp_path / "data-bin" / "out"
    for split in SPLITS:
        binarized, d = symbols(dest, split)
        assert binarized == [t for line in lines[split] for t in line.split() + ["\n"]]
    assert "%" in d and d.count[d.index("%")] == 0  # only in test: in the dictionary, never <unk>
    assert json.loads((dest / "data_prep.json").read_text())["unit"] == "character"
    err = capsys.readouterr().err
    assert ("characters and ends of line: " + ", ".join(f"{s} {tokens[s]:,}" for s in SPLITS)) in err


def test_char_ptb_of_other_sizes_than_the_published_is_one_line(tmp_path, small_char_ptb, monkeypatch):
    raw, lines, tokens = small_char_ptb
    monkeypatch.setitem(char_ptb.PUBLISHED, "lines", {**char_ptb.PUBLISHED["lines"], "valid": 3370})
    assert script_error(char_ptb, "--raw", raw, *dirs(tmp_path)) == (
        f"error: simple-examples/data/ptb.char.valid.txt has {len(lines['valid'])} lines, not the published 3,370: "
        "is it the file of simple-examples.tgz?")
    monkeypatch.setitem(char_ptb.PUBLISHED, "lines", {s: len(lines[s]) for s in SPLITS})
    monkeypatch.setitem(char_ptb.PUBLISHED, "tokens", {**char_ptb.PUBLISHED["tokens"], "train": (5_010_000, 10_000)})
    assert "ptb.char.train.txt has" in script_error(char_ptb, "--raw", raw, *dirs(tmp_path))
    assert not (tmp_path / "data-bin").exists()


def test_the_manuals_as_bytes_are_their_paragraphs_one_token_per_byte(tmp_path):
    paragraphs = fx.write_debian_docs(tmp_path / "raw")
    run_script(docs, "--raw", tmp_path / "raw", *dirs(tmp_path), "--bytes")
    dest = tmp_path / "data-bin" / "out"
    for split in SPLITS:
        assert as_bytes(symbols(dest, split)[0]) == "".join(p + "\n" for p in paragraphs[split]).encode()
    assert json.loads((dest / "data_prep.json").read_text())["unit"] == "byte"
    assert not list((tmp_path / "work").glob("bpe"))  # no tokenizer, no BPE


def test_training_and_eval_lm_report_bits_per_byte(tmp_path, small_enwik8):
    raw, data = small_enwik8
    run_script(enwik8, "--raw", raw, *dirs(tmp_path), "--no-newlines")
    dest = tmp_path / "data-bin" / "out"
    log = run("train", dest, *LM_MODEL, "--tokens-per-sample", 32, "--batch-size", 4, "--optimizer", "adam",
              "--lr", "0.003", "--max-update", 4, "--save-dir", tmp_path / "ckpt").stdout
    valid = re.search(r"valid on 'valid' subset \| loss ([\d.]+) \| ppl [\d.]+ \| bpb ([\d.]+)", log)
    assert valid and float(valid[1]) == pytest.approx(float(valid[2]), abs=1e-3)  # the loss in base 2, per byte
    out = run("eval_lm", dest, "--task", "feedback_language_modeling", "--path", tmp_path / "ckpt" / "checkpoint_last.pt",
              "--gen-subset", "test", "--tokens-per-sample", 32, "--batch-size", 1, "--cpu").stdout
    # the convention beside the number: enwik8's published numbers leave the newlines out
    assert re.search(r"Loss \(base 2\): [\d.]+ bits per byte \(the newlines not scored\), Perplexity: [\d.]+", out)
    assert f"Evaluated {400 - data[-400:].count(NEWLINE)} tokens" in out  # every test byte but the newlines, once
    # character-level data of another origin says what its tokens are (--token-unit), and data that records
    # its newlines as tokens says so
    other = tmp_path / "other"
    shutil.copytree(dest, other)
    (other / "data_prep.json").write_text(json.dumps({"newlines": True}))
    out = run("eval_lm", other, "--task", "feedback_language_modeling", "--path", tmp_path / "ckpt" / "checkpoint_last.pt",
              "--gen-subset", "test", "--tokens-per-sample", 32, "--batch-size", 1, "--cpu", "--token-unit",
              "character").stdout
    assert re.search(r"Loss \(base 2\): [\d.]+ bits per character \(each newline a scored token\), Perplexity: "
                     r"[\d.]+", out)
