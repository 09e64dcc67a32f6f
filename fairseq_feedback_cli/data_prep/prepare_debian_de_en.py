"""German-English sentence pairs from the translation catalogs Debian ships.

Programs translated with gettext ship one compiled catalog (.mo) per
language; a German one, under .../de/LC_MESSAGES/, maps each English message
of the program (msgid) to its German translation (msgstr). This script reads
the German catalogs of --packages (downloaded from Debian, see
fairseq_feedback_cli/data_prep/debian.py; or the .deb, .mo and .po files of --raw), keeps the
messages that are sentences, and makes a de-en corpus of them:

- dropped: plural forms, fuzzy and untranslated entries (and translations
  that copy the English), messages that are only placeholders (`%s: %s`), and
  pairs outside 3-80 words or with a length ratio over 2;
- cleaned: keyboard accelerators (`_File`, `&File`, `~File`: the one marked
  letter of a menu entry), HTML/Pango markup and entities, line breaks;
- split by source package: the source packages --test and --valid name make
  the test and valid sets, all others the training set; every English
  message appears once in the corpus (case and spacing aside), in test if a
  test package has it, else in valid, else in train, so no test sentence is
  trained on, not even as another package's copy;
- Moses-tokenized (case kept), joint BPE (subword-nmt) learnt on train de+en,
  fairseq-preprocess with one joined dictionary.

It prints, and writes to DEST/counts.json, what each package gave and the
pairs of each split; DEST/data_prep.json names every package with its version
and SHA256, and DEST/test.raw.en holds the untokenized test references for
sacreBLEU.
"""

import functools
import html
import json
import re
import struct
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep import debian
from fairseq_feedback_cli.data_prep.arguments import log, make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.text import tokenize, write_lines
from fairseq_feedback_cli.data_prep.translation import Corpus, JointBPE, prepare_translation

NAME = "debian_de_en"
LANGS = ("de", "en")
# Measured on bookworm (examples/debian_de_en/README.md): 72,741 pairs in all.
PACKAGES = ("aptitude-common", "binutils-common", "cinnamon-l10n", "coreutils", "digikam-data", "e2fsprogs-l10n",
            "evolution-common", "freeciv-data", "gcc-12-locales", "gettext", "gimp-data", "git", "gnucash-common",
            "gnumeric-common", "gramps", "inkscape", "libc-l10n", "libreoffice-l10n-de", "minetest-data", "mutt",
            "plasma-workspace-data", "tar", "util-linux-locales", "vlc-l10n", "wget")
TEST = ("gnucash", "coreutils")  # source packages
VALID = ("gnumeric", "tar")
MIN_WORDS, MAX_WORDS, MAX_RATIO = 3, 80, 2.0

GERMAN_CATALOG = re.compile(r"(^|/)de(_DE)?(\.[\w-]+)?/LC_MESSAGES/[^/]+\.mo$")
PLACEHOLDER = re.compile(r"%(\d+\$)?[-+ #0']*(\*|\d+)?(\.(\*|\d+))?(hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGaAcspnSm%]"
                         r"|%\(\w+\)[sdifr]|\{\w*(:[^{}]*)?\}|\$\{?\w+\}?")
MARKUP = re.compile(r"</?(a|b|big|br|code|em|i|kbd|p|qt|s|small|span|strong|sub|sup|tt|u)\b[^<>]*>", re.I)
ACCELERATORS = {"_": re.compile(r"_(?=[^\W_])"), "~": re.compile(r"~(?=[^\W_])"),
                "&": re.compile(r"&(?=[^\W_])(?!#?\w+;)")}  # not an entity such as &amp;
WORD = re.compile(r"[^\W\d_]{2}")


# ------------------------------------------------------------ the catalogs


def _charset(header: bytes) -> str:
    match = re.search(rb"charset=([\w.-]+)", header)
    return match.group(1).decode("ascii") if match and match.group(1) != b"CHARSET" else "utf-8"


def _decode(data: bytes, charset: str) -> str:
    try:
        return data.decode(charset, errors="replace")
    except LookupError:  # a charset Python does not know
        return data.decode("utf-8", errors="replace")


def read_mo(data: bytes, where: str):
    """(msgid, msgstr, fuzzy) of a compiled catalog, as gettext stores them: a
    context before "\\x04", plural forms joined by "\\x00"; never fuzzy."""
    order = {b"\xde\x12\x04\x95": "<", b"\x95\x04\x12\xde": ">"}.get(data[:4])
    if order is None:
        fail(f"{where} is not a gettext .mo catalog (wrong magic number)")
    try:
        n, originals, translations = struct.unpack_from(order + "3I", data, 8)
        strings = []
        for i in range(n):
            entry = []
            for table in (originals, translations):
                length, offset = struct.unpack_from(order + "2I", data, table + 8 * i)
                if offset + length > len(data):
                    raise struct.error("string past the end")
                entry.append(data[offset:offset + length])
            strings.append(entry)
    except struct.error:
        fail(f"{where} is a damaged .mo catalog (its tables point past its end)")
    charset = _charset(next((t for o, t in strings if o == b""), b""))
    return [(_decode(o, charset), _decode(t, charset), False) for o, t in strings]


PO_STRING = re.compile(r'(msgctxt|msgid|msgid_plural|msgstr(?:\[\d+\])?)\s+"(.*)"$')


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "r": "\r"}.get(m.group(1), m.group(1)), s)


def read_po(data: bytes, where: str):
    """The entries of a source catalog in read_mo's form, fuzzy marked;
    obsolete (#~) entries left out."""
    text = _decode(data, _charset(data[:4096]))
    entries, entry, key, fuzzy = [], {}, None, False

    def flush():
        nonlocal entry, fuzzy
        if any(k.startswith("msgstr") for k in entry):
            msgid = entry.get("msgid", "")
            if "msgctxt" in entry:
                msgid = entry["msgctxt"] + "\x04" + msgid
            if "msgid_plural" in entry:
                msgid += "\x00" + entry["msgid_plural"]
            msgstr = "\x00".join(v for k, v in sorted(entry.items()) if k.startswith("msgstr"))
            entries.append((msgid, msgstr, fuzzy))
            entry, fuzzy = {}, False

    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            flush()
            key = None
            fuzzy |= line.startswith("#,") and "fuzzy" in line
        elif match := PO_STRING.match(line):
            if match.group(1) in ("msgctxt", "msgid"):
                flush()
            key = match.group(1)
            entry[key] = _unescape(match.group(2))
        elif line.startswith('"') and line.endswith('"') and key:
            entry[key] += _unescape(line[1:-1])
        else:
            fail(f"{where} line {number} is not gettext .po syntax: {line[:60]!r}")
    flush()
    if not entries:
        fail(f"{where} holds no catalog entries: is it a gettext .po file?")
    return entries


def catalogs(inp: debian.Input):
    """(name, entries) of each German catalog of an input."""
    if inp.path.suffix == ".deb":
        for path, data in debian.deb_files(inp.path, GERMAN_CATALOG.search):
            yield path, read_mo(data, f"{inp.path.name}:{path}")
        return
    data = inp.path.read_bytes()
    entries = (read_mo if inp.path.suffix == ".mo" else read_po)(data, str(inp.path))
    header = next((t for i, t, _ in entries if i == ""), "")
    language = re.search(r"^Language: *(\S*)", header, flags=re.M)
    if language and language.group(1) and not re.fullmatch(r"de([_-]DE)?(\..*)?", language.group(1)):
        fail(f"{inp.path} is a catalog for {language.group(1)}, not German: take it out of --raw")
    yield inp.name, entries


# ---------------------------------------------------------------- cleaning


def clean(text: str) -> str:
    for mark, pattern in ACCELERATORS.items():
        if text.count(mark) == 1:  # a menu entry marks one letter; more are text
            text = pattern.sub("", text)
    text = html.unescape(MARKUP.sub(" ", text))
    return " ".join(text.split())


def pair_of(msgid: str, msgstr: str, fuzzy: bool):
    """(en, de), or why the entry is dropped."""
    if not msgid:
        return "header"
    if "\x00" in msgid:
        return "plural"
    if fuzzy:
        return "fuzzy"
    en, de = clean(msgid.split("\x04")[-1]), clean(msgstr)
    if not de or de == en:
        return "untranslated"
    if not WORD.search(PLACEHOLDER.sub("", en)):
        return "placeholders only"
    n_en, n_de = len(en.split()), len(de.split())
    if not (MIN_WORDS <= n_en <= MAX_WORDS and MIN_WORDS <= n_de <= MAX_WORDS) or \
            max(n_en, n_de) > MAX_RATIO * min(n_en, n_de):
        return "length"
    return en, de


# ---------------------------------------------------------------- the steps


def make_text(out: Path, inputs, workers: int, test, valid) -> None:
    pairs = {split: [] for split in debian.SPLITS}
    rows, dropped = [], Counter()
    for inp in inputs:
        split = "test" if inp.group in test else "valid" if inp.group in valid else "train"
        n_catalogs = n_entries = 0
        log(f"reading {inp.name} ...")
        for _, entries in catalogs(inp):
            n_catalogs += 1
            for entry in entries:
                result = pair_of(*entry)
                if result == "header":
                    continue
                n_entries += 1
                if isinstance(result, str):
                    dropped[result] += 1
                else:
                    pairs[split].append((*result, inp.name))
        rows.append({"source": inp.group, "package": inp.name, "version": inp.version, "split": split,
                     "catalogs": n_catalogs, "entries": n_entries})
    pairs, repeats = debian.without_repeats(pairs, key=lambda p: debian.normalized(p[0]))
    kept = Counter(name for split in pairs.values() for _, _, name in split)
    for row in rows:
        row["pairs"] = kept[row["package"]]
    for split, split_pairs in pairs.items():
        for i, lang in ((1, "de"), (0, "en")):
            lines = [p[i] for p in split_pairs]
            write_lines(out / f"{split}.raw.{lang}", lines)
            write_lines(out / f"{split}.{lang}", tokenize(lines, workers, f"{split}.{lang}", lang=lang))
    counts = {"inputs": rows, "pairs": {s: len(p) for s, p in pairs.items()},
              "dropped": {**dropped, **{f"repeated ({s})": n for s, n in repeats.items()}}}
    (out / "counts.json").write_text(json.dumps(counts, indent=1) + "\n")


def check_pairs(text: Path) -> None:
    pairs = json.loads((text / "counts.json").read_text())["pairs"]
    if not all(pairs.values()):
        fail(f"a split has no pairs ({pairs}): the inputs hold no German catalogs of sentences")


def report(text: Path) -> None:
    counts = json.loads((text / "counts.json").read_text())
    debian.print_table([[r[k] for k in ("source", "package", "version", "split", "catalogs", "entries", "pairs")]
                        for r in counts["inputs"]],
                       ("source", "package", "version", "split", "catalogs", "entries", "pairs"))
    print("pairs: " + ", ".join(f"{s} {n}" for s, n in counts["pairs"].items()))
    print("dropped: " + ", ".join(f"{why} {n}" for why, n in counts["dropped"].items()))


def main(argv=None) -> None:
    parser = make_parser(NAME, __doc__)
    debian.add_arguments(parser, PACKAGES)
    parser.add_argument("--test", nargs="+", default=list(TEST), metavar="SOURCE",
                        help="source packages whose pairs make the test set (default: %(default)s)")
    parser.add_argument("--valid", nargs="+", default=list(VALID), metavar="SOURCE",
                        help="source packages whose pairs make the valid set (default: %(default)s)")
    parser.add_argument("--bpe-merges", type=int, default=10000, help="joint BPE merges (default: %(default)s)")
    args = parser.parse_args(argv)
    resolve_dirs(args)
    if set(args.test) & set(args.valid):
        fail(f"{', '.join(sorted(set(args.test) & set(args.valid)))} cannot be in both --test and --valid")
    inputs = debian.gather(args, (".mo", ".po"))
    groups = {i.group for i in inputs}
    for option, names in (("--test", args.test), ("--valid", args.valid)):
        if missing := [n for n in names if n not in groups]:
            fail(f"{option} {' '.join(missing)}: no input comes from it; the inputs' source packages are "
                 f"{' '.join(sorted(groups))}")
    if len(groups - set(args.test) - set(args.valid)) == 0:
        fail("every input is in --test or --valid: nothing is left to train on")
    prepare_translation(args, Corpus(
        NAME, LANGS, {"dataset": NAME, "test": sorted(args.test), "valid": sorted(args.valid),
                      "sources": debian.manifest(inputs)},
        inputs=lambda: inputs, make_text=functools.partial(make_text, test=args.test, valid=args.valid),
        subwords=JointBPE(args.bpe_merges), keep=("counts.json", "test.raw.en"), after_text=check_pairs,
        report=report))


if __name__ == "__main__":
    run_cli(main)
