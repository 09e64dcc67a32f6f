"""Outputs that appear complete or not at all, where they can be written: for the tools and the data scripts."""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

from .command_line import fail

PathLike = Union[str, os.PathLike]


def check_destination(path: PathLike, option: str,
                      reads: Mapping[str, Union[None, PathLike, Sequence[PathLike]]] = {},
                      folder: bool = False) -> None:
    """Stops with one line naming `option` unless `path` can be written as
    what the command writes there (a file, or with `folder` a folder, made
    with the folders that will hold it), and is none of what the command
    reads (`reads`: its options and their paths), by path or by link, nor a
    folder holding one: checked before any work, rather than found when the
    result is ready to write (a folder where a file is wanted ended the
    benchmark in IsADirectoryError), or after it has replaced its own input
    or a file where a folder was wanted. Every tool of this project checks
    each of its outputs here. Tried for real, with a temporary folder made
    and removed where it would go, since permissions alone do not tell (a
    read-only disk, /proc, /sys)."""
    for read_option, paths in reads.items():
        for read in [paths] if isinstance(paths, (str, os.PathLike)) else paths or ():
            if _would_replace(Path(path), Path(read)):
                fail(f"{option} {path} would write over {read_option} {read}, which this command reads: "
                     "pass another path")
    path = Path(path).absolute()
    if folder and path.exists() and not path.is_dir():
        fail(f"{option} {path} is a file, not a folder: pass a folder (the file is left as it is)")
    if not folder and path.is_dir():
        fail(f"{option} {path} is a folder, and a file is written there: name a file, in it or elsewhere")
    if path.exists() and not path.is_file() and not path.is_dir():  # a device or a pipe: written, never replaced
        if not os.access(path, os.W_OK):
            fail(f"{option} {path} cannot be written (its permissions): pass a path you can write to")
        return
    holder = path if path.is_dir() else next(p for p in path.parents if p.exists())
    if not holder.is_dir():
        fail(f"{option} {path}: {holder} is a file, not a folder: check the path")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=holder))
    except OSError as e:
        fail(f"{option} {path}: nothing can be written in {holder} ({e.strerror}): pass a path you can write to")


def _would_replace(output: Path, read: Path) -> bool:
    """Whether writing `output` replaces `read`: the same file (by path, a
    symbolic link or a hard link), or a folder that holds it."""
    if not read.exists():
        return False
    if output.exists() and os.path.samefile(output, read):
        return True
    return output.resolve() in read.resolve().parents


def partial_path(path: Path) -> Path:
    # A fixed name beside the output, not a random one: the next run removes
    # what a killed run (even kill -9) left there.
    return path.with_name(path.name + ".tmp")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextlib.contextmanager
def atomic_file(path: PathLike, mode: str = "w", **open_kwargs) -> Iterator:
    """An open file that becomes `path` (replacing what was there) only when
    the block ends without an error; after an error `path` is as it was."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a device or a pipe (/dev/null, a FIFO): written, never replaced
        try:
            with open(path, mode, **open_kwargs) as f:
                yield f
        except BaseException as e:
            _name_unnamed_write(e, path)
            raise
        return
    partial = partial_path(path)
    try:
        # open() creates the file with the umask's permissions (mkstemp's would be private)
        with open(partial, mode, **open_kwargs) as f:
            yield f
        os.replace(partial, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        _name_unnamed_write(e, path)
        raise


@contextlib.contextmanager
def atomic_folder(path: PathLike, check: Optional[Callable[[Path], None]] = None) -> Iterator[Path]:
    """An empty folder to build in, which becomes `path` (replacing what was
    there) only when the block ends without an error; after an error it is
    removed and `path` is as it was.

    check(path) may refuse, by raising, to replace what is at `path`; it runs
    before the build and again before the swap, since a build can take hours.
    """
    path = Path(path).absolute()
    if check is not None:
        check(path)
    partial = partial_path(path)
    if partial.exists() or partial.is_symlink():
        _remove(partial)
    made = [folder for folder in partial.parents if not folder.exists()]  # innermost first
    partial.mkdir(parents=True)  # the umask's permissions (mkdtemp's would be private)
    try:
        yield partial
        if check is not None:
            check(path)
        if path.exists() or path.is_symlink():
            previous = path.with_name(path.name + ".old")
            if previous.exists() or previous.is_symlink():
                _remove(previous)
            path.rename(previous)
            partial.rename(path)
            _remove(previous)
        else:
            partial.rename(path)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        for folder in made:  # the folders made to hold it, unless something else went in
            with contextlib.suppress(OSError):
                folder.rmdir()
        _name_unnamed_write(e, path)
        raise


def _name_unnamed_write(exc: BaseException, path: Path) -> None:
    """A write the system refused names no file (a write call has only a
    descriptor; torch.save raises its own error over it): the output it was
    for, for the one line (command_line.command)."""
    for refused in (exc, exc.__cause__, exc.__context__):
        if isinstance(refused, OSError) and refused.filename is None:
            refused.filename = str(path)
