"""One run of the check: its options, folder and deadline (Check), its steps (Step), what a step
finds (Outcome) or why it failed (StepFailed, OutOfTime), and the commands a step runs as child
processes (Command), stopped at the deadline."""

import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .sizes import LOSS_TOLERANCE, SIZES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLUGIN = os.path.join(REPO, "fairseq_feedback")
NOT_MEASURED = "not measured on this device"
# the console scripts the report names, for the modules run as `python -m`
CONSOLE_SCRIPTS = {"fairseq_cli.preprocess": "fairseq-preprocess", "fairseq_cli.train": "fairseq-train",
                   "fairseq_cli.eval_lm": "fairseq-eval-lm", "fairseq_feedback_cli.benchmark": "feedback-benchmark"}

PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"
SKIPPED, STOPPED, INTERRUPTED = "skipped for time", "stopped for time", "interrupted"
NOT_JUDGED = "not judged"  # it ran, but what it checks did not happen (no graph could be captured)


@dataclass
class Outcome:
    """What a step found: a line, its figures (for report.json) and its section of report.md."""
    summary: str
    figures: dict = field(default_factory=dict)
    markdown: List[str] = field(default_factory=list)
    status: str = PASSED


class StepFailed(Exception):
    """A step's check failed, or one of its commands did: the message names it; `outcome`, what it found."""

    def __init__(self, message: str, outcome: Optional[Outcome] = None):
        super().__init__(message)
        self.outcome = outcome or Outcome(message)


class OutOfTime(Exception):
    """The deadline came while a step's commands ran (they were stopped)."""


@dataclass
class Command:
    """A module run as `python -m`, shown in the report as its console script; its output goes to logs/LOG."""
    module: str
    args: list
    log: str
    cwd: Optional[str] = None

    def __post_init__(self):
        self.args = [str(a) for a in self.args]

    @property
    def name(self) -> str:
        return CONSOLE_SCRIPTS.get(self.module, f"python -m {self.module}")

    def shown(self) -> str:
        return f"{self.name} {shlex.join(self.args)}"


def fairseq_save_dir(command: Command, folder: str) -> Optional[str]:
    """The --save-dir of a fairseq-train command (fairseq's default: checkpoints, in the folder it runs
    in); None for another tool, or a rank but the first. fairseq-train's first rank writes and removes a
    file there as it starts, --no-save or not."""
    if command.module != "fairseq_cli.train" or option_value(command.args, "--distributed-rank", "0") != "0":
        return None
    return os.path.normpath(os.path.join(command.cwd or folder, option_value(command.args, "--save-dir",
                                                                                "checkpoints")))


def option_value(args: List[str], option: str, default: str) -> str:
    """The value argparse reads for `option`: its last."""
    return args[len(args) - args[::-1].index(option)] if option in args else default


def launcher(module: str) -> List[str]:
    """How a command starts: its module under the Python that runs this check, whatever PATH holds."""
    return [sys.executable, "-m", module]


def child_env(device: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    if device == "cpu":  # the commands of a step run side by side, on few cores
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def stop(proc: subprocess.Popen) -> None:
    """The command and whatever it started (its own session)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def last_error(path: str) -> str:
    """The line of a log that says what went wrong: its last error, else its last line."""
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or re.match(r"[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or ["no output"])[-1][:400]


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@dataclass
class Step:
    key: str  # "3a": the part, then the step within it
    title: str
    # seconds, by size: "full" on one H100 (as measured there on 2026-11-27, docs/gpu.md; report.json
    # has each step's time beside its estimate), "tiny" on 2 CPU cores
    estimate: Dict[str, float]
    run: Callable[["Check"], Outcome]

    @property
    def part(self) -> int:
        return int(self.key[0])


class Check:
    """One run: its options, sizes, folder, deadline, and each step's record."""

    def __init__(self, args, folder: str, out: str, machine: dict, command: List[str]):
        self.args, self.sizes = args, SIZES[args.size]
        self.folder, self.out = folder, out  # where it is written, and the folder it becomes
        self.machine, self.command = machine, command
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60
        self.date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.records: List[dict] = []
        self.record: Optional[dict] = None  # the step running
        self.status = "running"
        os.makedirs(self.path("logs"))
        os.makedirs(self.path("work"))

    @property
    def graphs(self) -> str:
        """--cuda-graphs of the runs with graphs on: auto, or on the CPU emulate."""
        return self.args.cuda_graphs

    @property
    def on_cpu(self) -> bool:
        return self.args.device == "cpu"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, *parts) -> str:
        return os.path.join(self.folder, *map(str, parts))

    def shown(self, text: str) -> str:
        """`text` with the paths it will have once the folder is moved to --out."""
        return text.replace(self.folder, self.out)

    def tolerance(self, precision: str) -> float:
        return LOSS_TOLERANCE[precision] if self.args.tolerance is None else self.args.tolerance

    def device_flags(self, precision: str = "fp32") -> List[str]:
        """fairseq's options for the device and the precision."""
        flags = ["--cpu"] if self.on_cpu else []
        if precision == "fp16":
            # fairseq's fp16 optimizer flattens the fp32 copy onto a CUDA device unless told not to
            flags += ["--fp16", *(["--fp16-no-flatten-grads"] if self.on_cpu else [])]
        return flags

    def run(self, *commands: Command, check: bool = True) -> List[int]:
        """Runs `commands` side by side; their exit statuses. At the deadline
        it stops them and raises OutOfTime; with `check`, a command that
        failed raises StepFailed, naming it and its error."""
        save_dirs = [save_dir for save_dir in (fairseq_save_dir(command, self.folder) for command in commands)
                     if save_dir is not None]
        if len(set(save_dirs)) < len(save_dirs):  # each would remove the file the other checks its folder with
            raise StepFailed(f"fairseq-train runs side by side share a --save-dir: {', '.join(save_dirs)}")
        procs = []
        try:
            for command in commands:
                self.record["commands"].append(self.shown(command.shown()))
                self.record["logs"].append(f"logs/{command.log}")
                with open(self.path("logs", command.log), "w") as log:
                    procs.append(subprocess.Popen([*launcher(command.module), *command.args], stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  env=child_env(self.args.device), cwd=command.cwd or self.folder,
                                                  start_new_session=True))
            for proc in procs:
                proc.wait(timeout=max(0.0, self.left()))
        except subprocess.TimeoutExpired:
            raise OutOfTime() from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    stop(proc)
        codes = [proc.returncode for proc in procs]
        for command, code in zip(commands, codes):
            if check and code:
                raise StepFailed(f"{command.name} failed (exit {code}): "
                                 f"{last_error(self.path('logs', command.log))} (logs/{command.log})")
        return codes

    def begin(self, step: "Step") -> dict:
        """A new record, of the step now running: what report.json keeps of it, and its section of report.md."""
        self.record = {"step": step.key, "part": step.part, "title": step.title, "status": None, "summary": "",
                       "seconds": None, "estimate seconds": step.estimate[self.args.size], "commands": [],
                       "logs": [], "figures": {}, "markdown": []}
        self.records.append(self.record)
        return self.record

    def exit_status(self) -> int:
        statuses = {record["status"] for record in self.records}
        return 1 if statuses & {FAILED, INTERRUPTED} else 2 if statuses & {SKIPPED, STOPPED, NOT_JUDGED} else 0
