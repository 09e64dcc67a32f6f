"""Done markers: every step builds into `<path>.tmp` and is renamed into place with a marker
naming what it was made from, so an interrupted run never leaves anything that looks finished, a
rerun resumes at the first unfinished step, and a change anywhere upstream rebuilds what follows.
The last step, fairseq-preprocess, reads only text checked first, and stamps the dest with the
settings it was made from."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.outputs import atomic_folder

from .arguments import log
from .text import check_text

DONE = ".done"
SETTINGS_FILE = "data_prep.json"


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
             extra_files: Sequence[Path] = (), check: Optional[Callable[[Path], None]] = None,
             work: Optional[Path] = None, binarizer: Optional[Callable[[Path], None]] = None) -> None:
    """Run fairseq-preprocess (or binarizer(folder), which writes what it
    would) into a folder that becomes dest when complete (and, given `check`,
    when check(folder) found what it made right). What it reads is checked
    first (text.check_text), in one line naming the file and the line;
    fairseq-preprocess's log goes to WORK/fairseq-preprocess.log (`work`: by
    default the folder of what it reads), not to the screen, and where it
    still fails (a full disk) its last words make the one line."""
    inputs = preprocess_inputs(preprocess_args)
    for path in inputs:
        check_text(path, "check the raw files it is made from")
    log_path = (work or inputs[0].parent) / "fairseq-preprocess.log"
    with atomic_folder(dest) as tmp:
        if binarizer is not None:
            binarizer(tmp)
        else:
            # the same interpreter as ours, so the fairseq we were installed with
            cmd = [sys.executable, "-m", "fairseq_cli.preprocess", *preprocess_args,
                   "--destdir", str(tmp), "--workers", str(workers)]
            log(f"running fairseq-preprocess (its log: {log_path}) ...")
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w", encoding="utf-8") as output:
                rc = subprocess.run(cmd, stdout=output, stderr=output).returncode
            if rc != 0:
                fail(f"fairseq-preprocess failed with exit status {rc}: {last_words(log_path)} (its whole log: "
                     f"{log_path})")
        if check is not None:
            check(tmp)
        for f in extra_files:
            shutil.copy2(f, tmp / f.name)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")
    log(f"done: {dest}")


def preprocess_inputs(preprocess_args: Sequence[str]) -> List[Path]:
    """The text files fairseq-preprocess reads, as it names them: PREFIX.LANG of each --trainpref,
    --validpref and --testpref (comma-separated prefixes each), for the source (and the target, unless
    --only-source) language; PREFIX alone where no language is given."""
    args = list(preprocess_args)

    def value(flag):
        return args[args.index(flag) + 1] if flag in args else None

    langs = [value("--source-lang")] + ([] if "--only-source" in args else [value("--target-lang")])
    prefixes = [prefix for flag in ("--trainpref", "--validpref", "--testpref") if value(flag)
                for prefix in value(flag).split(",")]
    return [Path(f"{prefix}.{lang}" if lang else prefix) for prefix in prefixes for lang in langs]


def last_words(log_path: Path) -> str:
    """The last line a failed program wrote (a traceback's: the exception)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:300] if lines else "it wrote nothing"
