"""English language-model text from the HTML manuals Debian ships.

Documentation packages hold manuals as HTML pages (the Python, Linux kernel,
PostgreSQL, Django and git manuals by default). Their prose is in the pages'
<p> elements, while code, examples and tables live elsewhere (<pre>,
<table>, ...). This script reads every HTML page of --packages (downloaded
from Debian, see data_prep/debian.py; or the .deb and .html files of --raw)
and keeps its paragraphs that read as English prose:

- a paragraph is the text of one <p>, inline markup and code words kept,
  whitespace squeezed; dropped: under 8 words, and text where under 15% of the
  words are common English function words (translated pages, lists of names,
  code-like text);
- split by page: a page goes to test or valid by a hash of its package and
  path (about 2.5% of pages each), so test text is whole unseen pages; every
  paragraph appears once in the corpus (case and spacing aside), in test if a
  test page has it, else valid, else train, so boilerplate repeated on many
  pages is never tested on after being trained on;
- one paragraph per line, pages in order, Moses-tokenized (case kept), BPE
  (subword-nmt) learnt on train, fairseq-preprocess --only-source: the data
  of `--task feedback_language_modeling` and of fairseq's language_modeling;
  or, with --bytes, the paragraphs as they are, one token per byte of their
  UTF-8, as enwik8 (data_prep/characters.py; default dest
  data-bin/debian_docs_bytes).

It prints, and writes to DEST/counts.json, what each package gave and the
paragraphs and words of each split; DEST/data_prep.json names every package
with its version and SHA256.
"""

import functools
import hashlib
import json
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep import debian
from fairseq_feedback_cli.data_prep.characters import (binarize_characters, byte_dictionary, byte_tokens,
                                                       write_bytes, write_dictionary)
from fairseq_feedback_cli.data_prep.arguments import log, make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.steps import binarize, dest_is_done, step
from fairseq_feedback_cli.data_prep.text import apply_bpe, learn_bpe, tokenize, write_lines

NAME = "debian_docs"
# Measured on bookworm (examples/debian_docs/README.md): 5.5M words of prose.
PACKAGES = ("python3.11-doc", "linux-doc-6.1", "postgresql-doc-15", "python-django-doc", "git-doc",
            "debian-reference-en")
HTML = (".html", ".htm")
HELD_OUT = {"test": 25, "valid": 25}  # per mille of the pages
MIN_WORDS, MIN_FUNCTION_WORDS = 8, 0.15
FUNCTION_WORDS = frozenset("a an and are as at be by can for from has have if in into is it its not of on or "
                           "that the their there these this to was were which will with you your".split())


class Paragraphs(HTMLParser):
    """The text of a page's <p> elements, without what <pre>, <script> or <style> hold."""

    SKIP = {"pre", "script", "style"}

    def __init__(self):
        super().__init__()
        self.paragraphs, self._text, self._open, self._skip = [], [], False, 0

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self._end()  # an unclosed <p> ends where the next begins
            self._open = True
        elif tag in self.SKIP:
            self._skip += 1

    def handle_endtag(self, tag):
        if tag == "p":
            self._end()
        elif tag in self.SKIP and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if self._open and not self._skip:
            self._text.append(data)

    def _end(self):
        if self._open:
            self.paragraphs.append(" ".join("".join(self._text).split()))
        self._open, self._text = False, []

    def close(self):
        super().close()
        self._end()


def paragraphs(page: bytes):
    parser = Paragraphs()
    parser.feed(page.decode("utf-8", errors="replace"))
    parser.close()
    return parser.paragraphs


def is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    function_words = sum(w.lower() in FUNCTION_WORDS for w in words)
    return len(words) >= MIN_WORDS and function_words >= MIN_FUNCTION_WORDS * len(words)


def split_of(page: str) -> str:
    bucket = int(hashlib.sha256(page.encode()).hexdigest()[:8], 16) % 1000
    return "test" if bucket < HELD_OUT["test"] else "valid" if bucket < sum(HELD_OUT.values()) else "train"


def pages(inp: debian.Input):
    """(name, content) of the input's HTML pages, in order: PACKAGE/PATH in a
    .deb, the path in --raw for a loose page."""
    if inp.path.suffix == ".deb":
        for path, page in sorted(debian.deb_files(inp.path, lambda path: path.endswith(HTML))):
            yield f"{inp.name}/{path}", page
    else:
        yield inp.name, inp.path.read_bytes()


def make_text(out: Path, inputs, workers: int, moses: bool = True) -> None:
    texts = {split: [] for split in debian.SPLITS}
    rows, dropped = [], Counter()
    for inp in inputs:
        log(f"reading {inp.name} ...")
        n_pages = Counter()
        for name, page in pages(inp):
            split = split_of(name)
            n_pages[split] += 1
            for paragraph in paragraphs(page):
                if is_prose(paragraph):
                    texts[split].append((paragraph, inp.name))
                else:
                    dropped["short" if len(paragraph.split()) < MIN_WORDS else "not prose"] += 1
        rows.append({"package": inp.name, "version": inp.version, "pages": sum(n_pages.values()),
                     **{f"{s} pages": n_pages[s] for s in debian.SPLITS}})
    texts, repeats = debian.without_repeats(texts, key=lambda t: debian.normalized(t[0]))
    words = Counter()
    for split in texts.values():
        for paragraph, name in split:
            words[name] += len(paragraph.split())
    for row in rows:
        row["words"] = words[row["package"]]
    for split, kept in texts.items():
        prose = [p for p, _ in kept]
        write_lines(out / f"{split}.txt", tokenize(prose, workers, split, lang="en") if moses else prose)
    counts = {"inputs": rows,
              "paragraphs": {s: len(t) for s, t in texts.items()},
              "words": {s: sum(len(p.split()) for p, _ in t) for s, t in texts.items()},
              "dropped": {**dropped, **{f"repeated ({s})": n for s, n in repeats.items()}}}
    (out / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")


def make_bpe(out: Path, text: Path, merges: int, workers: int) -> None:
    learn_bpe([text / "train.txt"], out / "code", merges, workers)
    for split in debian.SPLITS:
        apply_bpe(out / "code", text / f"{split}.txt", out / f"{split}.txt", workers)


def make_bytes(out: Path, text: Path) -> None:
    data = {split: (text / f"{split}.txt").read_bytes() for split in debian.SPLITS}
    for split in debian.SPLITS:
        write_bytes(data[split], out / f"{split}.txt")
    write_dictionary(byte_dictionary(data["train"]), out / "dict.txt")
    (out / "tokens.json").write_text(json.dumps({split: byte_tokens(data[split]) for split in debian.SPLITS}) + "\n")


def report(counts: dict) -> None:
    header = ("package", "version", "pages", *(f"{s} pages" for s in debian.SPLITS), "words")
    debian.print_table([[r[k] for k in header] for r in counts["inputs"]], header)
    for what in ("paragraphs", "words"):
        print(f"{what}: " + ", ".join(f"{s} {n}" for s, n in counts[what].items()))
    print("dropped paragraphs: " + ", ".join(f"{why} {n}" for why, n in counts["dropped"].items()))


def main(argv=None) -> None:
    parser = make_parser(NAME, __doc__)
    debian.add_arguments(parser, PACKAGES)
    parser.add_argument("--bpe-merges", type=int, default=16000, help="BPE merges (default: %(default)s)")
    parser.add_argument("--bytes", action="store_true", help="one token per byte of the paragraphs' text, "
                        "without tokenization or BPE (default dest: data-bin/debian_docs_bytes)")
    args = parser.parse_args(argv)
    if args.bytes and args.dest == parser.get_default("dest"):
        args.dest = args.dest.with_name(NAME + "_bytes")
    resolve_dirs(args)
    inputs = debian.gather(args, HTML)
    text_settings = {"dataset": NAME, "sources": debian.manifest(inputs), **({"unit": "byte"} if args.bytes else {})}
    settings = text_settings if args.bytes else {**text_settings, "bpe_merges": args.bpe_merges}
    if dest_is_done(args.dest, settings):
        return
    text = step(args.work / "text", functools.partial(make_text, inputs=inputs, workers=args.workers,
                                                      moses=not args.bytes), text_settings)
    counts = json.loads((text / "counts.json").read_text())
    if not all(counts["paragraphs"].values()):
        fail(f"a split has no text ({counts['paragraphs']} paragraphs): the inputs need more HTML pages of prose")
    if args.bytes:
        made = step(args.work / "bytes", functools.partial(make_bytes, text=text), settings)
        binarize_characters(args.dest, settings, {split: made / f"{split}.txt" for split in debian.SPLITS},
                            made / "dict.txt", args.workers, json.loads((made / "tokens.json").read_text()),
                            extra_files=[text / "counts.json"])
        report(counts)
        return
    bpe = step(args.work / "bpe", functools.partial(make_bpe, text=text, merges=args.bpe_merges,
                                                    workers=args.workers), settings)
    binarize(args.dest, settings,
             ["--only-source", "--trainpref", str(bpe / "train.txt"), "--validpref", str(bpe / "valid.txt"),
              "--testpref", str(bpe / "test.txt")],
             args.workers, extra_files=[bpe / "code", text / "counts.json"], work=args.work)
    report(counts)


if __name__ == "__main__":
    run_cli(main)
