"""Whose exception it is: fairseq's (fairseq, fairseq_cli, omegaconf, hydra), or this plugin's (or a
program of one's own).

Its frames are read from the innermost out, passing over the standard library's and the other installed
libraries' (torch, numpy: they run what they are asked to; torch's C++ operators have no frame): the
first other frame decides. An exception torch carried as text from another process (a rank of
torch.multiprocessing.spawn, a DataLoader worker) is read from that text: its frames, type and message.
"""

import dataclasses
import functools
import importlib.util
import io
import linecache
import os
import re
import sysconfig
import traceback

FAIRSEQ = ("fairseq", "fairseq_cli", "omegaconf", "hydra")
PLUGIN = ("fairseq_feedback", "fairseq_feedback_cli")

# torch's text of an exception from another process (spawn's ProcessRaisedException, a DataLoader worker's)
CARRIED = re.compile(r"Traceback \(most recent call last\):\n")
# the longest expression read whole, in lines
STATEMENT_LINES = 6
FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in .*$', re.M)


@dataclasses.dataclass
class Frame:
    file: str
    line: int
    end_line: int
    locals: dict  # empty for a frame read from text


@dataclasses.dataclass
class Raised:
    type_name: str  # as Python prints it: builtins bare, others with their module
    message: str
    frames: list  # outermost first
    carried: bool  # read from the text of another process

    def is_a(self, exception_type) -> bool:
        return self.type_name.rsplit(".", 1)[-1] == exception_type.__name__


def raised(exc: BaseException) -> Raised:
    """The exception as it was raised: in this process, or in the process it was carried from."""
    summaries = traceback.extract_tb(exc.__traceback__)
    frames = [Frame(s.filename, s.lineno, s.end_lineno or s.lineno, tb_frame.f_locals)
              for s, (tb_frame, _) in zip(summaries, traceback.walk_tb(exc.__traceback__))]
    text = str(exc)
    carried = list(CARRIED.finditer(text))
    if not carried:
        name = type(exc).__qualname__
        module = type(exc).__module__
        return Raised(name if module == "builtins" else f"{module}.{name}", text, frames, False)
    text = text[carried[-1].end():]  # after a chain of exceptions, the last one
    found = list(FRAME.finditer(text))
    frames += [Frame(m["file"], int(m["line"]), int(m["line"]), {}) for m in found]
    after = text[found[-1].end():] if found else text
    lines = after.strip("\n").splitlines()
    while lines and lines[0].startswith("    "):  # the last frame's source line and its carets
        lines.pop(0)
    type_name, _, message = "\n".join(lines).partition(": ")
    return Raised(type_name.strip(), message.strip(), frames, True)


def deciding_frame(frames):
    """The frame that decides whose exception it is (None if every frame is a library's)."""
    return next((frame for frame in reversed(frames) if _owner(frame.file) != "library"), None)


def in_fairseq(frame) -> bool:
    return frame is not None and _owner(frame.file) == "fairseq"


def fairseq_frames(frames):
    """fairseq's frames, innermost first."""
    return [frame for frame in reversed(frames) if _owner(frame.file) == "fairseq"]


def module_name(frame) -> str:
    """fairseq.data.dictionary for .../site-packages/fairseq/data/dictionary.py."""
    path = os.path.realpath(frame.file)
    for root in _roots(FAIRSEQ + PLUGIN):
        if path.startswith(root):
            parent = os.path.dirname(root.rstrip(os.sep))
            return os.path.splitext(os.path.relpath(path, parent))[0].replace(os.sep, ".").removesuffix(".__init__")
    return path


def statement(frame) -> str:
    """The source of the expression a frame was running, in one line (the first line of a longer one:
    a `for` loop spans its body)."""
    last = frame.end_line if frame.end_line - frame.line < STATEMENT_LINES else frame.line
    lines = (linecache.getline(frame.file, n).strip() for n in range(frame.line, last + 1))
    return " ".join(line for line in lines if line)


def files_open(frame):
    """The files a frame of a function holds, open or named by a path: what fairseq was reading."""
    for name, value in frame.locals.items():
        path = getattr(value, "name", None) if isinstance(value, io.IOBase) else value
        if not name.startswith("__") and isinstance(path, str) and len(path) < 4096 and os.path.isfile(path):
            yield path


def _owner(file: str) -> str:
    """"fairseq", "plugin", "library" (passed over) or "other" (a program of one's own)."""
    if file.startswith("<"):  # <frozen runpy>, <string> (code fairseq evaluated)
        return "library"
    if not os.path.isabs(file) and not os.path.exists(file):  # a compiled module's source, as Cython names it
        return "library"  # (numpy/random/mtrand.pyx: np.random.seed refusing fairseq's --seed)
    path = os.path.realpath(file)
    for owner, packages in (("fairseq", FAIRSEQ), ("plugin", PLUGIN)):
        if path.startswith(_roots(packages)):
            return owner
    return "library" if path.startswith(_libraries()) else "other"


@functools.lru_cache(maxsize=None)
def _roots(packages) -> tuple:
    roots = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.join(os.path.realpath(location), ""))
    return tuple(roots)


@functools.lru_cache(maxsize=None)
def _libraries() -> tuple:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(os.path.realpath(paths[key]), "") for key in ("stdlib", "platstdlib", "purelib",
                                                                          "platlib")})
