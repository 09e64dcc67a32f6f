"""Text, as fairseq's recipes process it: files read and written line by line, Moses tokenization
(sacremoses), clean-corpus-n's filter of sentence pairs, joint BPE (subword-nmt), and the lines of
each split counted."""

import functools
import itertools
import multiprocessing
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

from tqdm import tqdm

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.sgm import segments

from .arguments import log


# A byte-order mark (Windows editors write one) at the start of a file: fairseq-preprocess, which
# reads the files some scripts hand it as they are, makes it part of the first word, a word of dict.txt
BOM = b"\xef\xbb\xbf"


class NotText(SystemExit, Exception):
    """fail()'s exit, for a file that is not text as the scripts read it (_not_text), and an
    Exception too: read_lines runs in pmap's workers and in the thread that feeds them, which pass an
    Exception on to the command, where a plain exit would end them silently and the pool would wait
    forever."""


def read_lines(path: Path) -> Iterator[str]:
    """The lines of a text file, without their ends; every text file the scripts read goes through here
    or check_text, which refuse bytes that are not UTF-8 (they were replaced without a word) and a
    byte-order mark, in one line naming the file and the line."""
    # Split on "\n" only: some corpora hold stray "\r" or U+2028 inside a
    # line, and splitting on those would misalign parallel files.
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise NotText(f"error: {_not_text(path, number, line, e, 'this script', 'convert it')}") from None
            if number == 1 and line.startswith(BOM):
                raise NotText(f"error: {_not_text(path, 1, line, None, 'this script', 'remove it')}")
            yield text.rstrip("\r\n")


def write_lines(path: Path, lines: Iterable[str]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")
            n += 1
    return n


def pmap(fn: Callable, items: Iterable, workers: int, desc: str, total: Optional[int] = None) -> Iterator:
    """fn over items, in order, across `workers` processes, with a progress bar."""
    bar = functools.partial(tqdm, desc=desc, total=total, unit=" lines", mininterval=2, disable=None)
    if workers <= 1:
        yield from bar(map(fn, items))
        return
    with multiprocessing.Pool(workers) as pool:
        yield from bar(pool.imap(fn, items, chunksize=500))


def parallel_segments(paths: Dict[str, Sequence[Path]]) -> Dict[str, List[str]]:
    """The segments of each language's .sgm/.xml test sets (read as
    feedback-score reads its references), one file of each language at a
    time: files of a pair that hold different numbers of segments would pair
    sentences with the wrong translations, so that stops the script."""
    found = {lang: [] for lang in paths}
    for files in zip(*paths.values()):
        counts = {}
        for lang, path in zip(paths, files):
            segs = segments(read_lines(path), str(path))
            counts[path.name] = len(segs)
            found[lang] += segs
        if len(set(counts.values())) > 1:
            fail("the test sets do not pair up, segment for segment: "
                 + ", ".join(f"{name} has {n}" for name, n in counts.items()) + "; fetch them again")
    return found


@functools.lru_cache(maxsize=None)
def _moses(lang: str):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang), MosesTokenizer(lang)


@functools.lru_cache(maxsize=None)
def _non_printing():
    import regex

    return regex.compile(r"\p{C}")


def moses(line: str, lang: str, normalize: bool = False, aggressive: bool = False,
          lower: bool = False, quote: bool = False) -> str:
    """Moses tokenization as tokenizer.perl (escaping on), plus the usual extras.

    normalize: normalize-punctuation.perl then remove-non-printing-char.perl;
    quote: the recipes' `sed "s/’/'/g"` on test sets; lower: lowercase.perl.
    """
    normalizer, tokenizer = _moses(lang)
    if normalize:
        line = _non_printing().sub(" ", normalizer.normalize(line))
    if quote:
        line = line.replace("\u2019", "'")
    line = tokenizer.tokenize(line, aggressive_dash_splits=aggressive, return_str=True)
    return line.lower() if lower else line


def tokenize(lines: Iterable[str], workers: int, desc: str, **moses_kwargs) -> Iterator[str]:
    return pmap(functools.partial(moses, **moses_kwargs), lines, workers, f"tokenize {desc}")


def read_pairs(src: Path, tgt: Path) -> Iterator[tuple]:
    """The lines of two parallel files side by side; an error if their lengths differ."""
    end = object()
    for s, t in itertools.zip_longest(read_lines(src), read_lines(tgt), fillvalue=end):
        if s is end or t is end:
            fail(f"{src} and {tgt} have different line counts, so they are not a parallel corpus")
        yield s, t


def clean_corpus(src: Path, tgt: Path, min_len: int, max_len: int, ratio: float) -> Iterator[tuple]:
    """Pairs kept by Moses' clean-corpus-n.perl (-ratio `ratio`, cutoff min-max), whitespace squeezed."""
    for s, t in read_pairs(src, tgt):
        s = " ".join(s.replace("|", "").split())
        t = " ".join(t.replace("|", "").split())
        if not s or not t:
            continue
        ns, nt = s.count(" ") + 1, t.count(" ") + 1
        if not (min_len <= ns <= max_len and min_len <= nt <= max_len):
            continue
        if ns / nt > ratio or nt / ns > ratio:
            continue
        if max(map(len, s.split(" "))) > 1000 or max(map(len, t.split(" "))) > 1000:
            continue
        yield s, t


def learn_bpe(train_files: Sequence[Path], codes: Path, merges: int, workers: int) -> None:
    """subword-nmt learn_bpe on the concatenation of train_files (a joint BPE, as fairseq's recipes)."""
    from subword_nmt.learn_bpe import learn_bpe as _learn

    joined = codes.with_name("bpe-train.txt")
    with open(joined, "wb") as out:
        for f in train_files:
            with open(f, "rb") as inp:
                shutil.copyfileobj(inp, out)
    log(f"learning {merges} BPE merges on {', '.join(f.name for f in train_files)} ...")
    with open(joined, encoding="utf-8") as inp, open(codes, "w", encoding="utf-8") as out:
        _learn(inp, out, merges, num_workers=workers)
    joined.unlink()


@functools.lru_cache(maxsize=None)
def _bpe(codes: str):
    from subword_nmt.apply_bpe import BPE

    with open(codes, encoding="utf-8") as f:
        return BPE(f)


def _bpe_line(line: str, codes: str) -> str:
    return _bpe(codes).process_line(line)


def apply_bpe(codes: Path, src: Path, dst: Path, workers: int) -> int:
    fn = functools.partial(_bpe_line, codes=str(codes))
    return write_lines(dst, pmap(fn, read_lines(src), workers, f"apply BPE to {src.name}"))




def check_text(path: Path, made_from: str) -> None:
    """One line naming `path` unless it is text fairseq-preprocess (or the BPE
    learnt on it) can take: present, UTF-8 (fairseq-preprocess failed with
    its traceback), without a byte-order mark (BOM), and with text in it
    (subword-nmt failed on an empty train split with `max() arg is an empty
    sequence`, and fairseq-preprocess makes a split of nothing); `made_from`:
    what to check instead."""
    if not path.is_file():
        fail(f"{path} is missing, and fairseq-preprocess would read it: {made_from}")
    has_text, before = False, 0
    with open(path, "rb") as f:
        while batch := f.readlines(1 << 24):  # whole lines: no character is cut between two batches
            if before == 0 and batch[0].startswith(BOM):
                fail(_not_text(path, 1, batch[0], None, "fairseq-preprocess", f"{made_from}, or remove it"))
            try:
                text = b"".join(batch).decode("utf-8")
            except UnicodeDecodeError:
                number, line, error = next((before + i, line, e) for i, line in enumerate(batch, 1)
                                           for e in [_utf8_error(line)] if e is not None)
                fail(_not_text(path, number, line, error, "fairseq-preprocess", f"{made_from}, or convert it"))
            has_text = has_text or (text != "" and not text.isspace())
            before += len(batch)
    if not has_text:
        fail(f"{path} holds no text, and fairseq-preprocess would make a split of nothing of it: {made_from}")


def _not_text(path: Path, number: int, line: bytes, error: Optional[UnicodeDecodeError], reader: str,
              fix: str) -> str:
    """Why line `number` of `path` is not text `reader` reads as written: bytes that are not UTF-8
    (`error`), else a byte-order mark; `fix`: what to do, to which the command that does it is added."""
    if error is None:
        return (f"{path}, line 1: begins with a byte-order mark, which {reader} would read as part of its first "
                f"word: {fix} (sed -i '1s/^\\xEF\\xBB\\xBF//' {path})")
    return (f"{path}, line {number}: not UTF-8 (byte 0x{line[error.start]:02x} at byte {error.start + 1} of the "
            f"line), and {reader} reads UTF-8: {fix} (iconv -t utf-8)")


def _utf8_error(line: bytes) -> Optional[UnicodeDecodeError]:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as e:
        return e
    return None


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def log_counts(name: str, what: str, counts: Dict[str, int]) -> None:
    """The size of each split made, to compare with fairseq's on the official archives."""
    log(f"{what}: " + ", ".join(f"{split} {n:,}" for split, n in counts.items())
        + f" (the official archives give: examples/{name}/README.md)")
