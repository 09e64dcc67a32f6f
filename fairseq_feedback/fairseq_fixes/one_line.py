"""The one line that ends a fairseq tool run on a mistake, instead of a traceback, by one rule
(docs/reliability.md, "One line for a mistake, a traceback for a defect"):

- this plugin's FeedbackUsageError: its message; a path the system refused, and the few exceptions of
  fairseq whose message one line can complete (a sentence too long; parameters that do not fit): a line
  naming the fix;
- any other exception raised in fairseq's code (origin.py tells): its type and message in fairseq's
  words, where it was raised (the module, the options its message names or its failing statement
  reads, the file it was reading) and how to see the traceback (FAIRSEQ_FEEDBACK_TRACEBACK=1);
- None for one raised in this plugin's code (or a program of one's own): a defect, whose traceback shows.

fairseq's tools print it through patches.py's exception hook; this project's tools through their main.
"""

import os
import re
import shlex
import sys

from ..errors import PATH_FIXES, FeedbackUsageError
from . import origin

# set (to anything but empty) to see every exception's traceback
TRACEBACK = "FAIRSEQ_FEEDBACK_TRACEBACK"
# how far from where fairseq raised to look for the options and the file it was using, in frames
NEAR = 3
# the most of fairseq's message that the line quotes (a state dict's mismatches run to pages)
MESSAGE_CHARS = 600


def one_line(exc: BaseException):
    """The line that ends a tool on `exc`, or None where its traceback must show."""
    if os.environ.get(TRACEBACK):
        return None
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or a kill (runs.py), wherever it landed
        return _interrupted(fairseq_tool())
    if not isinstance(exc, Exception):  # an exit: as Python shows it
        return None
    raised = origin.raised(exc)
    if raised.carried:  # from a rank, or a DataLoader worker: as text
        if raised.is_a(FeedbackUsageError):
            return raised.message
    else:
        line = _named_mistake(exc)
        if line is not None:
            return line
    return _in_fairseqs_words(raised)


def _interrupted(tool: str) -> str:
    if tool == "fairseq-train":
        return ("interrupted: what the run had finished is kept, and nothing it left looks finished "
                "(fairseq-train resumes from its newest complete checkpoint when run again)")
    return (f"interrupted: {tool or 'the tool'} stopped before it finished, and nothing it left looks finished (a "
            "--results-path keeps the results it held); rerun the same command, which starts over")


def fairseq_tool() -> str:
    """The fairseq tool this process runs, as its command is named (fairseq-train), started by `python -m`
    or as a console script (also under torchrun); empty for any other program."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("fairseq_cli."):
        return "fairseq-" + spec.name.rsplit(".", 1)[-1].replace("_", "-")
    name = os.path.basename(sys.argv[0]) if sys.argv else ""
    return name if name.startswith("fairseq-") else ""


def _named_mistake(exc: Exception):
    if isinstance(exc, FeedbackUsageError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename and exc.errno in PATH_FIXES:
        return _path_refused(exc)
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    if str(exc).startswith("Size of sample"):  # fairseq's filter_by_size: its message names the fix
        # numpy 2 writes its sizes as np.int64(1101)
        return re.sub(r"np\.\w+\(([^()]*)\)", r"\1", str(exc).replace("\n", " "))
    unfit = re.match(r"Cannot load model parameters from checkpoint (.*); please ensure", str(exc))
    if unfit and exc.__context__ is not None:  # fairseq's trainer, hiding the reason in the exception it replaced
        lines = [line.strip() for line in str(exc.__context__).splitlines() if line.strip()]
        reason = next((line for line in lines if "mismatch" in line or "key(s)" in line), lines[0] if lines else "")
        return (f"the parameters of {unfit.group(1)} do not fit this model ({reason[:200]}): continue it with the "
                "options and the data (dictionaries) it was trained with")
    return None


def _in_fairseqs_words(raised):
    frame = origin.deciding_frame(raised.frames)
    if not origin.in_fairseq(frame):
        return None
    words = "; ".join(line.strip() for line in raised.message.splitlines() if line.strip())
    words = words or origin.statement(frame)  # a bare assert: its condition
    if len(words) > MESSAGE_CHARS:
        words = words[:MESSAGE_CHARS] + " ..."
    where = "; ".join(_where(raised.frames, raised.message))
    return f"{raised.type_name}: {words} ({where}; for the whole traceback, rerun with {TRACEBACK}=1)"


def _where(frames, message):
    """Where fairseq raised: its module (in omegaconf's or hydra's, with fairseq's that called it), the
    options its message names or the failing statement reads (else a caller's, up to NEAR frames out),
    and the file it was reading."""
    inner = origin.fairseq_frames(frames)  # innermost first
    modules = [origin.module_name(frame) for frame in inner]
    called_from = next((f", from {name}" for name in modules if name.startswith("fairseq")), "")
    where = [f"in {modules[0]}" + ("" if modules[0].startswith("fairseq") else called_from)]
    given = _given_options(sys.argv[1:])
    named = {name for name in given if _in_words(message, name)}
    for frame in inner[:NEAR]:  # where fairseq failed, else the frames just outside
        in_code = {name for name in given if _in_code(origin.statement(frame), name)}
        if in_code:
            named |= in_code
            break
    if named:
        where.append("check " + ", ".join(option for name, option in given.items() if name in named))
    read = next((path for frame in inner[:NEAR] for path in origin.files_open(frame)), None)
    if read is not None:
        where.append(f"reading {read}")
    return where


def _given_options(argv) -> dict:
    """{name as fairseq's configuration spells it: the option as given} for each --option of a command line."""
    given = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--") and len(arg) > 2:
            flag, equals, value = arg.partition("=")
            if not equals and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            given[flag[2:].replace("-", "_")] = shlex.join([flag, value]) if value else flag
    return given


def _in_words(message: str, name: str) -> bool:
    """Whether fairseq's (or omegaconf's) message names an option: by its flag, or as a key of the configuration."""
    flag = re.escape("--" + name.replace("_", "-"))
    return re.search(rf"(?<![\w-]){flag}(?![\w-])|full_key: {name}\b", message) is not None


def _in_code(statement: str, name: str) -> bool:
    """Whether fairseq's code reads an option, from a configuration: cfg.generation.beam, self.args.lr."""
    return re.search(rf"\w*(?:cfg|args)(?:\.\w+)*\.{name}\b", statement) is not None


def _path_refused(exc: OSError) -> str:
    name = str(exc.filename)
    if isinstance(exc, FileNotFoundError):
        if name.endswith(".txt") and "dict." in name.rsplit("/", 1)[-1]:
            return (f"dictionary {name} not found: point the data directory at the --destdir "
                    "of fairseq-preprocess (which writes the dictionaries)")
        return f"{name} not found: check the path"
    return f"{name}: {exc.strerror}: {PATH_FIXES[exc.errno]}"
