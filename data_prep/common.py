"""Shared plumbing for the data_prep scripts.

Every script follows the same shape: find the raw files (download the official
archives, or take them from --raw), run a few text-processing steps in a work
dir, and binarize with fairseq-preprocess into the dest dir.  Each step builds
into `<path>.tmp` and is renamed into place with a marker only when complete
(fairseq_feedback_cli.outputs), so an interrupted run never leaves anything that looks
finished and a rerun resumes at the first unfinished step.
"""

import argparse
import functools
import gzip
import hashlib
import http.client
import itertools
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

from tqdm import tqdm

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.outputs import atomic_folder

DONE = ".done"
SETTINGS_FILE = "data_prep.json"
SPLITS = ("train", "valid", "test")


def log(message: str) -> None:
    print(f"[data_prep] {message}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[], None]) -> None:
    try:
        main()
    except KeyboardInterrupt:
        fail("interrupted; rerun the same command to resume")


# ---------------------------------------------------------------- arguments


def make_parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--raw", type=Path, help="folder holding the official archives, or the files extracted "
                   "from them (default: download the archives into the work dir)")
    p.add_argument("--dest", type=Path, default=Path("data-bin") / name,
                   help="binarized output for fairseq-train (default: %(default)s)")
    p.add_argument("--work", type=Path, help="intermediate files (default: data-raw/<dest name>, "
                   "beside the dest's parent folder)")
    p.add_argument("--workers", type=int, default=max(1, min(8, multiprocessing.cpu_count())),
                   help="processes for tokenization, BPE and fairseq-preprocess (default: %(default)s)")
    return p


def resolve_dirs(args: argparse.Namespace) -> None:
    args.dest = args.dest.resolve()
    if args.work is None:
        args.work = args.dest.parent.parent / "data-raw" / args.dest.name
    args.work = args.work.resolve()
    if args.raw is not None:
        args.raw = args.raw.resolve()
        if not args.raw.is_dir():
            fail(f"--raw {args.raw} is not a folder")
    if args.workers < 1:
        fail("--workers must be at least 1")


# ----------------------------------------------------------------- archives


@dataclass(frozen=True)
class Archive:
    filename: str  # the name on disk
    urls: Sequence[str]  # tried in order
    checksum: str  # "sha256:<hex>" or "md5:<hex>"
    # Paths inside the archive the script reads; a trailing "/" takes a whole folder.
    members: Sequence[str]
    # Not an archive but the input itself; its one member then says where it
    # sits in its repository, e.g. "url_lists/all_train.txt".
    plain: bool = False


def file_digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksum_matches(path: Path, archive: Archive) -> Optional[str]:
    """None when `path` has the archive's checksum, else a description of the mismatch."""
    algo, expected = archive.checksum.split(":", 1)
    log(f"checking the {algo} of {path.name} ...")
    actual = file_digest(path, algo)
    return None if actual == expected else f"{algo} is {actual}, expected {expected}"


def _fetch(url: str, part: Path) -> None:
    """Download url into `part`, resuming from what `part` already holds."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "fairseq-feedback-data-prep"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing past what we have: the part is whole
            return
        raise
    with resp:
        if have and resp.status != 206:  # the server ignored the Range: start over
            have = 0
        if "text/html" in resp.headers.get("Content-Type", ""):
            # e.g. Google Drive's quota or virus-scan page instead of the file
            raise OSError("the server sent a web page, not the file")
        total = None if resp.length is None else have + resp.length
        with open(part, "ab" if have else "wb") as f, tqdm(
            total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=part.name[:-5]
        ) as bar:
            for block in iter(lambda: resp.read(1 << 20), b""):
                f.write(block)
                bar.update(len(block))
    if total is not None and part.stat().st_size != total:
        raise OSError(f"the connection closed after {part.stat().st_size} of {total} bytes")


def download(archive: Archive, folder: Path) -> Path:
    """The archive in `folder`, downloaded (resumably) and verified if not there yet.

    The final name appears only after the checksum matched, so a file under
    that name needs no second check.
    """
    final = folder / archive.filename
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / (archive.filename + ".part")
    errors = []
    for url in archive.urls:
        log(f"downloading {url} -> {part}")
        try:
            _fetch(url, part)
            break
        except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError, timeouts are OSErrors
            errors.append(f"{url}: {e}")
    else:
        fail(f"could not download {archive.filename} ({'; '.join(errors)}); rerun to resume, "
             f"or fetch it by hand into a folder and pass --raw FOLDER")
    mismatch = checksum_matches(part, archive)
    if mismatch:
        part.unlink()
        fail(f"downloaded {archive.filename} is corrupt ({mismatch}); removed it, rerun to download it again")
    part.rename(final)
    return final


def _wanted(name: str, members: Sequence[str]) -> bool:
    name = name[2:] if name.startswith("./") else name
    return any(name == m or (m.endswith("/") and name.startswith(m)) for m in members)


def extract(path: Path, members: Sequence[str], out: Path) -> None:
    """Extract `members` (files, or folders ending in "/") of a .tgz/.tar/.zip into `out`."""
    found = set()
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                for name in zf.namelist():
                    if _wanted(name, members):
                        zf.extract(name, out)
                        found.add(name)
        else:
            with tarfile.open(path) as tf:
                for info in tf:
                    if (info.isfile() or info.isdir()) and _wanted(info.name, members):
                        # the "data" filter refuses absolute paths and links out of `out`
                        tf.extract(info, out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                        found.add(info.name[2:] if info.name.startswith("./") else info.name)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as e:
        fail(f"cannot read {path} ({e}); delete it and rerun")
    for m in members:
        if not any(f == m.rstrip("/") or (m.endswith("/") and f.startswith(m)) for f in found):
            fail(f"{path} has no {m}: is it the right archive? delete it and rerun")


def _locate_extracted(raw: Path, member: str) -> Optional[Path]:
    """A member already extracted into raw: at its path in the archive, or under a shorter tail of it."""
    parts = Path(member.rstrip("/")).parts
    for i in range(len(parts)):
        candidate = raw.joinpath(*parts[i:])
        if candidate.exists():
            return candidate
    return None


def in_raw(archive: Archive, raw: Optional[Path]) -> Optional[Dict[str, Path]]:
    """The archive's members already extracted into --raw, or None when one is not there."""
    if raw is None:
        return None
    hits = {m: _locate_extracted(raw, m) for m in archive.members}
    return hits if all(hits.values()) else None


def identity(path: Path) -> dict:
    """How a done marker knows an input again: its path, size and modification
    time (a folder: a digest of its files' names, sizes and times).

    Not a hash of the content: the inputs are gigabytes (or 300k files) that
    every rerun would read again, while whatever rewrites a file gives it a
    new modification time.
    """
    if not path.is_dir():
        st = path.stat()
        return {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    listing, count = hashlib.sha1(), 0
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            st = os.stat(os.path.join(root, name))
            listing.update(f"{os.path.relpath(os.path.join(root, name), path)}\t{st.st_size}\t"
                           f"{st.st_mtime_ns}\n".encode())
            count += 1
    return {"path": str(path), "files": count, "listing_sha1": listing.hexdigest()}


def describe_sources(archives: Sequence[Archive], raw: Optional[Path]) -> Dict[str, object]:
    """What the dataset is made from, for the done markers, without downloading
    anything: each file read in place from --raw by its identity(), each
    archive by its checksum (it is verified before use, so that names its content)."""
    sources = {}
    for archive in archives:
        found = in_raw(archive, raw)
        if found is None:
            sources[archive.filename] = archive.checksum
        else:
            sources.update({m: identity(p) for m, p in found.items()})
    return sources


def gather_inputs(archives: Sequence[Archive], raw: Optional[Path], work: Path) -> Dict[str, Path]:
    """Map every member of every archive to a readable path.

    With --raw, files already extracted there are used in place (nothing to
    check them against); otherwise the archive, from --raw or downloaded, is
    verified and its members extracted into work/extracted/<archive>/.
    """
    paths = {}
    for archive in archives:
        found = in_raw(archive, raw)
        if found is not None:
            paths.update(found)
            continue
        if raw is not None:
            missing = next(m for m in archive.members if _locate_extracted(raw, m) is None)
            path = raw / archive.filename
            if archive.plain:
                fail(f"{raw} has no {missing}")
            if not path.is_file():
                fail(f"{raw} has neither {archive.filename} nor its file {missing}")
        else:
            path = download(archive, work / "downloads")
        if archive.plain:
            paths[archive.members[0]] = path
            continue

        def build(tmp: Path, path=path, archive=archive) -> None:
            # a downloaded archive was checked before it got its name
            if raw is not None and (mismatch := checksum_matches(path, archive)):
                fail(f"{path} is corrupt or partial ({mismatch}); delete it and download it again")
            log(f"extracting {path.name} ...")
            extract(path, archive.members, tmp)

        out = step(work / "extracted" / archive.filename, build, {"checksum": archive.checksum})
        paths.update({m: out / m.rstrip("/") for m in archive.members})
    return paths


# -------------------------------------------------------------------- steps


def step(path: Path, build: Callable[[Path], None], made_from: dict) -> Path:
    """The folder `path`, built by build(tmp_folder) unless already built from the same `made_from`.

    `made_from` holds every option that shapes the output and the identities
    of the inputs (describe_sources); pass a step those of the steps it reads
    from as well, so a change anywhere upstream rebuilds everything after it.
    """
    stamp = json.dumps(made_from, sort_keys=True)
    marker = path / DONE
    if marker.exists() and marker.read_text() == stamp:
        log(f"skip {path.name}: already done ({path})")
        return path
    log(f"making {path} ...")
    with atomic_folder(path) as tmp:
        build(tmp)
        (tmp / DONE).write_text(stamp)
    return path


def _names(keys: Sequence[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _differences(old: dict, new: dict) -> Iterator[str]:
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) or isinstance(b, dict):  # the sources: name what changed, not the whole record
            a, b = (x if isinstance(x, dict) else {} for x in (a, b))
            yield f"{key}: {_names([k for k in set(a) | set(b) if a.get(k) != b.get(k)])} changed"
        else:
            yield f"{key}: {a} -> {b}"


def dest_is_done(dest: Path, settings: dict) -> bool:
    """True when dest was already made from these settings and sources (a rerun then has nothing to do)."""
    f = dest / SETTINGS_FILE
    if not dest.exists():
        return False
    if not f.exists():
        fail(f"{dest} exists but was not made by this script; move it away or pass another --dest")
    old = json.loads(f.read_text())
    if old != settings:
        fail(f"{dest} was made from other settings or inputs ({', '.join(_differences(old, settings))}); "
             "delete it or pass another --dest")
    log(f"{dest} is complete already; nothing to do")
    return True


def binarize(dest: Path, settings: dict, preprocess_args: List[str], workers: int,
             extra_files: Sequence[Path] = ()) -> None:
    """Run fairseq-preprocess into a folder that becomes dest when complete."""
    with atomic_folder(dest) as tmp:
        # the same interpreter as ours, so the fairseq we were installed with
        cmd = [sys.executable, "-m", "fairseq_cli.preprocess", *preprocess_args,
               "--destdir", str(tmp), "--workers", str(workers)]
        log("running fairseq-preprocess ...")
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            fail(f"fairseq-preprocess failed with exit status {rc} (its messages are above)")
        for f in extra_files:
            shutil.copy2(f, tmp / f.name)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    log(f"done: {dest}")


# --------------------------------------------------------------------- text


def read_lines(path: Path) -> Iterator[str]:
    # Split on "\n" only: some corpora hold stray "\r" or U+2028 inside a
    # line, and splitting on those would misalign parallel files.
    with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
        for line in f:
            yield line.rstrip("\r\n")


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


SEG = re.compile(r'<seg id="?[^">]*"?>\s*(.*?)\s*</seg>')


def sgm_segments(path: Path) -> List[str]:
    """The text of the `<seg id="N"> ... </seg>` lines of an .sgm/.xml test set."""
    out = []
    for line in read_lines(path):
        if "<seg id" in line:
            m = SEG.search(line)
            out.append(m.group(1) if m else "")
    return out


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


def translation_parser(name: str, description: str, default_merges: int) -> argparse.ArgumentParser:
    parser = make_parser(name, description)
    parser.add_argument("--bpe-merges", type=int, default=default_merges,
                        help="joint BPE merges (default: %(default)s)")
    return parser


def prepare_translation(args: argparse.Namespace, name: str, archives: Sequence[Archive], make_text, make_bpe,
                        source: str, target: str, options: Optional[dict] = None) -> None:
    """The translation datasets' pipeline: raw files -> tokenized text ->
    joint BPE -> fairseq-preprocess with a joined dictionary. `options` are
    the dataset's own choices that shape the text (recorded with the rest)."""
    resolve_dirs(args)
    made_from = {"dataset": name, **(options or {}), "sources": describe_sources(archives, args.raw)}
    settings = {**made_from, "bpe_merges": args.bpe_merges}
    if dest_is_done(args.dest, settings):
        return
    files = gather_inputs(archives, args.raw, args.work)
    text = step(args.work / "text", functools.partial(make_text, files=files, workers=args.workers), made_from)
    bpe = step(args.work / "bpe", functools.partial(make_bpe, text=text, merges=args.bpe_merges,
                                                    workers=args.workers), settings)
    binarize(args.dest, settings,
             ["--source-lang", source, "--target-lang", target, "--joined-dictionary",
              "--trainpref", str(bpe / "train"), "--validpref", str(bpe / "valid"), "--testpref", str(bpe / "test")],
             args.workers, extra_files=[bpe / "code"])
    log_counts(name, "sentence pairs", {split: count_lines(bpe / f"{split}.{source}") for split in SPLITS})


def count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))


def log_counts(name: str, what: str, counts: Dict[str, int]) -> None:
    """The size of each split made, to compare with fairseq's on the official archives."""
    log(f"{what}: " + ", ".join(f"{split} {n:,}" for split, n in counts.items())
        + f" (the official archives give: examples/{name}/README.md)")
