"""A file given as a checkpoint, read the one way every tool reads it.

fairseq-train (--restore-file, --finetune-from-model, the checkpoints of
--save-dir), fairseq-generate, -eval-lm and -interactive (--path), the hub,
feedback-average-checkpoints and feedback-evaluate-toy read checkpoints
through read(), or check the file with check_file() before fairseq's loader
reads it: a file that is not a checkpoint fairseq wrote is named in one
line (FeedbackUsageError), with what was found in it, rather than torch's
traceback (`[enforce fail at inline_container.cc:180] file in archive is not
in a subdirectory` for a zip archive of something else, `Invalid magic
number; corrupt file?` for a pickle) or a KeyError deep in fairseq.

The format is told without unpickling anything (the zip archive's
directory, the first bytes), and what is unpickled is unpickled by torch's
weights-only rule, with the allowlist of safe_checkpoints.py.
"""

import os
import pickle
import zipfile

import torch

from .errors import FeedbackUsageError
from .safe_checkpoints import fairseq_checkpoints_allowed, refusal

CHECK = "check the path, or pass a checkpoint that fairseq-train wrote"
CUT_SHORT = "is truncated (its save or copy was cut short) and cannot be loaded: use a complete checkpoint"
# the start of a file torch.save wrote in its format from before torch 1.6: its magic number, pickled
LEGACY_START = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)


def is_complete(path) -> bool:
    """Whether a checkpoint file is whole: torch.save's zip archive has its
    central directory, which is written last, so a file cut short at any
    point lacks it."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def is_cut_short(path) -> bool:
    """Whether a file is the start of a zip archive (or empty) without its end: a save or a copy cut short."""
    with open(path, "rb") as f:
        return not is_complete(path) and b"PK\x03\x04".startswith(f.read(4))


def check_file(path) -> None:
    """One line naming `path` unless it is a file torch.save wrote, whole: in
    torch's zip format (the checkpoints of torch 1.6 and later) or its
    format from before (a pickle, read by torch). A missing path is left to
    the caller."""
    if os.path.isdir(path):
        raise FeedbackUsageError(f"{path} is a folder, not a checkpoint file: name the .pt file in it, as "
                                 f"{os.path.join(path, 'checkpoint_best.pt')}")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        start = f.read(len(LEGACY_START))
    if is_complete(path):
        _check_archive(path)
    elif is_cut_short(path):
        raise FeedbackUsageError(f"{path} {CUT_SHORT}")
    elif start[:1] == b"\x80" and not LEGACY_START.startswith(start):  # pickle's first byte, not torch's magic
        raise FeedbackUsageError(f"{path} is a Python pickle, not a file torch.save wrote: {CHECK}")
    elif start[:1] != b"\x80":
        raise FeedbackUsageError(f"{path} is {_what_it_is(path, start)}, not a checkpoint: {CHECK}")


def _check_archive(path) -> None:
    """A zip archive is torch.save's when everything in it lies in one folder holding data.pkl (torch's reader
    refuses any other); one that also holds code/ is a TorchScript model, which torch.load hands to
    torch.jit.load."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    folders = {name.split("/", 1)[0] for name in names}
    if len(folders) != 1 or f"{next(iter(folders))}/data.pkl" not in names:
        shown = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise FeedbackUsageError(f"{path} is a zip archive of something else than a checkpoint (it holds "
                                 f"{shown or 'nothing'}): {CHECK}")
    if any(name.split("/")[1:2] == ["code"] for name in names):
        raise FeedbackUsageError(f"{path} is a TorchScript model (torch.jit.save), not a checkpoint: pass the "
                                 "checkpoint that fairseq-train wrote")


def _what_it_is(path, start: bytes) -> str:
    if start.startswith(b"\x1f\x8b"):
        return "a gzip archive (fairseq's pretrained models come as model.tar.gz: unpack it, and pass its model.pt)"
    with open(path, "rb") as f:
        head = f.read(200)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"a file of {os.path.getsize(path):,} bytes that begins {head[:8].hex(' ')}"
    first = text.splitlines()[0][:60] if text.strip() else ""
    return f"a text file (it begins {first!r})" if first.isprintable() else "a file of other data"


def read(path, mmap: bool = True) -> dict:
    """The state a checkpoint file holds (a dict with the model's parameters),
    unpickled by torch's weights-only rule with the classes fairseq stores
    allowed; with `mmap`, its tensors stay on disk until used. Anything else
    is one line naming the file and what it holds."""
    check_file(path)
    with fairseq_checkpoints_allowed():
        try:
            # torch's format from before 1.6 cannot be mapped
            state = torch.load(path, map_location="cpu", mmap=mmap and is_complete(path), weights_only=True)
        except Exception as e:
            check_loaded(path, e)
            raise
    check_state(path, state)
    return state


def check_loaded(path, error: BaseException) -> None:
    """One line for what torch could not load from a file check_file let through (a pickle it refused, one cut
    short); nothing for any other error."""
    line = refusal(path, error)
    if line is not None:
        raise FeedbackUsageError(line) from None
    if isinstance(error, EOFError) or "truncated" in str(error):  # torch's format from before 1.6, cut short
        raise FeedbackUsageError(f"{path} {CUT_SHORT}") from None


def check_state(path, state) -> None:
    """What a loaded file holds is a checkpoint: a dict with the model's parameters."""
    if not isinstance(state, dict):
        raise FeedbackUsageError(f"{path} holds a {type(state).__name__}, not a checkpoint (a dict of the model's "
                                 f"parameters and its options): {CHECK}")
    if not isinstance(state.get("model"), dict):
        raise FeedbackUsageError(f"{path} holds no model's parameters, so it is not a checkpoint that fairseq-train "
                                 "wrote: check the path")
