"""enwik8 for character-level language modelling, split as every published number is.

enwik8 is the first 100,000,000 bytes of an English Wikipedia dump (the
Hutter Prize file, enwik8.zip). As Transformer-XL's prep_enwik8.py splits
it: the first 90M bytes train, the next 5M valid, the last 5M test; one
token per byte (data_prep/characters.py: a newline byte is fairseq's end of
line), a dictionary of every byte, fairseq-preprocess --only-source. With
--no-newlines, the stream that Transformer-XL's loader and the authors' code
read and score, on which every published enwik8 number is measured: the
newline bytes left out, every other byte a token. The input must be the
100,000,000 bytes, and each binarized split must hold a token per byte
(newlines aside): otherwise nothing is written.
"""

import functools
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep.arguments import log, make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.characters import (binarize_characters, byte_dictionary, byte_tokens,
                                                       write_bytes, write_dictionary)
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs
from fairseq_feedback_cli.data_prep.steps import dest_is_done, step

NAME = "enwik8"
ARCHIVES = {
    "enwik8.zip": Archive(
        "enwik8.zip",
        ("https://mattmahoney.net/dc/enwik8.zip", "http://mattmahoney.net/dc/enwik8.zip"),
        "sha256:547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
        ("enwik8",),
    ),
}
BYTES = 100_000_000
HELD_OUT = {"valid": 5_000_000, "test": 5_000_000}  # the last 10M bytes, in this order


def split(data: bytes) -> dict:
    valid, test = HELD_OUT["valid"], HELD_OUT["test"]
    return {"train": data[:-(valid + test)], "valid": data[-(valid + test):-test], "test": data[-test:]}


def make_text(out: Path, enwik8: Path, newlines: bool) -> None:
    data = enwik8.read_bytes()
    if len(data) != BYTES:
        fail(f"{enwik8} holds {len(data):,} bytes, not the {BYTES:,} of enwik8: is it the file of enwik8.zip?")
    splits = split(data)
    for name, part in splits.items():
        write_bytes(part, out / f"{name}.txt", newlines)
    write_dictionary(byte_dictionary(splits["train"]), out / "dict.txt")
    counts = {name: {"bytes": len(part), "newlines": part.count(b"\n"), "tokens": byte_tokens(part, newlines)}
              for name, part in splits.items()}
    (out / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")


def main(argv=None) -> None:
    parser = make_parser(NAME, __doc__)
    parser.add_argument("--no-newlines", action="store_true",
                        help="leave the newline bytes out of the stream, as Transformer-XL's loader (add_eos=False) "
                             "and the authors' code (without --data-eos) read enwik8: the convention of its published "
                             "numbers (default: a newline is a token, fairseq's end of line)")
    args = parser.parse_args(argv)
    resolve_dirs(args)
    archives = list(ARCHIVES.values())
    settings = {"dataset": NAME, "unit": "byte", "newlines": not args.no_newlines,
                "sources": describe_sources(archives, args.raw)}
    if dest_is_done(args.dest, settings):
        return
    files = gather_inputs(archives, args.raw, args.work)
    text = step(args.work / "text", functools.partial(make_text, enwik8=files["enwik8"], newlines=not args.no_newlines),
                settings)
    counts = json.loads((text / "counts.json").read_text())
    binarize_characters(args.dest, settings, {name: text / f"{name}.txt" for name in counts}, text / "dict.txt",
                        args.workers, {name: c["tokens"] for name, c in counts.items()},
                        extra_files=[text / "counts.json"], newlines=not args.no_newlines)
    newlines = ", ".join(f"{c['newlines']:,}" for c in counts.values())
    log("bytes: " + ", ".join(f"{name} {c['bytes']:,}" for name, c in counts.items())
        + (f", without their newlines ({newlines}): the convention of the published numbers" if args.no_newlines else
           f", each newline a token ({newlines}): not the convention of the published numbers, which leave the "
           "newlines out (--no-newlines)") + " (the published split: examples/enwik8/README.md)")


if __name__ == "__main__":
    run_cli(main)
