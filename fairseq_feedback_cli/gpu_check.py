"""feedback-gpu-check: the CUDA-graph path checked and measured on a GPU, in one command.

    feedback-gpu-check --out gpu-check                       # on a GPU, from a checkout: 8 minutes or less
    feedback-gpu-check --device cpu --cuda-graphs emulate    # the same sequence at tiny sizes on the CPU

In this order, so that a short lease gets the most important answers first:

  1  the GPU tests, in one process (python -m pytest -q -m gpu tests), when it runs from a
     checkout; elsewhere it says that the tests are not there, and goes on;
  2  fairseq-train on a translation corpus it generates (data_prep's synthetic translation),
     with --cuda-graphs auto and with off, in fp32 and with --fp16: the losses logged must
     agree to --tolerance;
  3  3a, 3b feedback-benchmark in fp16 at IWSLT's translation size and the language-model
     size: graphs against eager against fairseq's Transformer (steady words/s, the first
     batches' words/s with every capture, capture seconds per new shape, decoding tokens/s,
     peak GPU memory); 3c fairseq-eval-lm's tokens/s at the language-model size;
  4  two ranks with graphs on (NCCL on two GPUs; gloo sharing one GPU, or on the CPU) against
     one rank with twice the batch: the same parameters after a few updates.

A step that would not fit in what is left of --minutes (by its estimate) is skipped for time,
and one still running at the deadline is stopped; the report says which. The report
(report.md), every figure with the machine (report.json) and each command's output (logs/)
are written into OUT.tmp beside --out, where report.md says how far the run has got, and
OUT.tmp becomes OUT when the run ends. Exit status: 0 when every step asked for passed;
1 when one failed (the last line names it); 2 when none failed but some were skipped or
stopped for time. How to read the report: docs/gpu-check.md.
"""

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from .command_line import ArgumentParser, check_at_least, fail
from .outputs import atomic_file, atomic_folder
from .sizes import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(REPO, "fairseq_feedback")
MARKER = ".feedback-gpu-check"  # marks a folder this check wrote (and may replace)
NOT_MEASURED = "not measured on this device"
# the console scripts the report names, for the modules run as `python -m`
CONSOLE_SCRIPTS = {"fairseq_cli.preprocess": "fairseq-preprocess", "fairseq_cli.train": "fairseq-train",
                   "fairseq_cli.eval_lm": "fairseq-eval-lm", "fairseq_feedback_cli.benchmark": "feedback-benchmark"}

# fairseq's losses (bits per token) with and without graphs may differ by this much: the graphs run
# at padded shapes, whose kernels round differently, and the difference grows over the updates
LOSS_TOLERANCE = {"fp32": 0.01, "fp16": 0.05}
# two ranks against one with twice the batch: parameters within atol + rtol * |parameter|
PARAMETER_TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def translation_model(embed_dim: int, ffn_dim: int, heads: int) -> List[str]:
    """A feedback_transformer of 2 + 2 layers, without dropout (graphs and eager then draw no masks)."""
    sizes = [str(a) for side in ("encoder", "decoder")
             for a in (f"--{side}-layers", 2, f"--{side}-embed-dim", embed_dim, f"--{side}-ffn-embed-dim", ffn_dim,
                       f"--{side}-attention-heads", heads)]
    return ["--arch", "feedback_transformer", "--share-all-embeddings", "--dropout", "0", *sizes]


# "full": one GPU within 8 minutes (small models for the comparisons, the benchmark's IWSLT sizes for
# the speeds); "tiny": the same sequence on 2 CPU cores within 2 minutes
SIZES = {
    "full": dict(
        translation=dict(corpus=["--train", 4000, "--valid", 200], model=translation_model(128, 512, 4),
                         batch=["--max-tokens", 2048], updates=200),
        benchmark=dict(preset="iwslt", first_batches=12),
        # enough blocks per stream that eval-lm's rate, whose timer includes the capture, is mostly replays
        eval_lm=dict(preset="iwslt", corpus=["--train", 8000, "--valid", 14000]),
        two_ranks=dict(model=translation_model(128, 512, 4), batch=8, updates=10),
    ),
    "tiny": dict(
        translation=dict(corpus=["--train", 400, "--valid", 40], model=translation_model(32, 64, 2),
                         batch=["--max-tokens", 500], updates=20),
        benchmark=dict(preset="tiny", first_batches=4),
        eval_lm=dict(preset="tiny", corpus=["--train", 300, "--valid", 100]),
        two_ranks=dict(model=translation_model(32, 64, 2), batch=8, updates=4),
    ),
}

PASSED, FAILED, NOT_RUN = "passed", "failed", "not run"
SKIPPED, STOPPED, INTERRUPTED = "skipped for time", "stopped for time", "interrupted"


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
    # seconds, by size: "full" on one H100 (a guess until a GPU run times it: report.json has each
    # step's time beside its estimate), "tiny" on 2 CPU cores
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

    # --- the report ----------------------------------------------------------------------------------

    def exit_status(self) -> int:
        statuses = {record["status"] for record in self.records}
        return 1 if statuses & {FAILED, INTERRUPTED} else 2 if statuses & {SKIPPED, STOPPED} else 0

    def write_report(self) -> None:
        """report.md and report.json as the run stands, each replaced whole."""
        seconds = time.monotonic() - self.started
        steps = [{k: v for k, v in record.items() if k != "markdown"} for record in self.records]
        with atomic_file(self.path("report.json")) as f:
            json.dump({"status": self.status, "exit status": None if self.status == "running" else self.exit_status(),
                       "date": self.date, "command": self.command, "options": vars(self.args),
                       "seconds": round(seconds, 1), "machine": self.machine, "steps": steps}, f, indent=1)
        with atomic_file(self.path("report.md")) as f:
            f.write(self.markdown(seconds))

    def headline(self) -> str:
        if self.status == "running":
            return (f"RUNNING (step {self.record['step'] if self.record else '-'}; this report is rewritten after "
                    "each step, and says it is finished when it is)")
        failed = [record["step"] for record in self.records if record["status"] in (FAILED, INTERRUPTED)]
        return self.status.upper() + (f": {', '.join(failed)}" if failed else "")

    def markdown(self, seconds: float) -> str:
        lines = [f"# feedback-gpu-check: {self.headline()}", "",
                 f"{self.date}, `{shlex.join(self.command)}`: {seconds / 60:.1f} of {self.args.minutes:g} minutes "
                 f"on {self.machine['device']}; sizes {self.args.size}, graphs `--cuda-graphs {self.graphs}`.", "",
                 "## Machine", "", "| | |", "|---|---|",
                 *[f"| {key} | {value} |" for key, value in self.machine.items() if key != "gpus"], "",
                 "## Steps", "", "| step | what | status | seconds (estimate) | result |", "|---|---|---|---:|---|"]
        for record in self.records:
            took = "" if record["seconds"] is None else f"{record['seconds']:.0f}"
            lines.append(f"| {record['step']} | {record['title']} | {record['status']} | "
                         f"{took} ({record['estimate seconds']:.0f}) | {record['summary']} |")
        part = None
        for record in self.records:
            heading = f"{record['step']}. {record['title']}: {record['status']}"
            if record["step"] == str(record["part"]):  # a part of one step
                lines += ["", f"## {heading}"]
            else:
                if record["part"] != part:
                    lines += ["", f"## {record['part']}. {PARTS[record['part']]}"]
                lines += ["", f"### {heading}"]
            part = record["part"]
            lines += ["", record["summary"], "", *record["markdown"]]
            if record["commands"]:
                lines += ["", "Commands (their output: " + ", ".join(f"`{log}`" for log in record["logs"]) + "):", "",
                          *[f"    {command}" for command in record["commands"]]]
        return "\n".join(lines) + "\n"


# --- 1: the GPU tests -------------------------------------------------------------------------------


def checkout_tests() -> Optional[str]:
    """The tests folder of the checkout this copy runs from; None for an installed copy, which has none."""
    tests = os.path.join(REPO, "tests")
    return tests if os.path.isfile(os.path.join(tests, "conftest.py")) else None


def pytest_counts(log: str) -> Dict[str, int]:
    """pytest's summary line, by outcome: {"passed": 17, "skipped": 3, ...}."""
    summary = [line for line in log.splitlines()
               if re.search(r"\d+ (passed|failed|skipped|deselected|errors?)\b", line)]
    if not summary:
        return {}
    return {outcome: int(n) for n, outcome in re.findall(r"(\d+) ([a-z]+)", summary[-1])}


def gpu_tests(check: Check) -> Outcome:
    tests = checkout_tests()
    if tests is None:
        return Outcome("the tests are not there: this copy of fairseq-feedback was installed without them "
                       "(run the check from a checkout, installed with pip install -e '.[test]', to include them)",
                       status=NOT_RUN)
    if importlib.util.find_spec("pytest") is None:
        return Outcome("pytest is not installed: pip install -e '.[test]' in the checkout", status=NOT_RUN)
    command = Command("pytest", ["-q", "-m", "gpu", "-rfEs", "-p", "no:cacheprovider", os.path.basename(tests)],
                      "gpu-tests.log", cwd=os.path.dirname(tests))
    code, = check.run(command, check=False)
    log = read(check.path("logs", command.log))
    counts = pytest_counts(log)
    said = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    failed = [line.split()[1] for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    outcome = Outcome(said, {"pytest exit status": code, **counts, "failed": failed},
                      [f"On {check.machine['device']}: {said}.", "", *[f"- failed: `{test}`" for test in failed]])
    if code != 0 or not counts.get("passed", 0) + counts.get("skipped", 0):
        raise StepFailed(f"pytest exit {code}: {said or 'no summary'}" + (f"; failed: {', '.join(failed)}" if failed
                                                                          else ""), outcome)
    if check.on_cpu:
        outcome.summary += " (the GPU tests skip without a CUDA device)"
    elif counts.get("skipped"):
        outcome.summary += f" (why each skipped: logs/{command.log})"
    return outcome


# --- 2: fairseq-train with and without graphs -------------------------------------------------------


def generated_corpus(check: Check, name: str, corpus: list) -> str:
    """data_prep's synthetic translation corpus, in work/NAME/raw."""
    raw = check.path("work", name, "raw")
    check.run(Command("fairseq_feedback_cli.data_prep.synthetic_translation", ["--out", raw, *corpus, "--test", 1],
                      f"{name}-corpus.log"))
    return raw


def parallel_corpus(check: Check, name: str, corpus: list) -> str:
    """The synthetic corpus binarized for translation (src -> tgt, one dictionary): its data directory."""
    raw, data = generated_corpus(check, name, corpus), check.path("work", name, "data-bin")
    check.run(Command("fairseq_cli.preprocess", ["--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                                                 f"{raw}/train", "--validpref", f"{raw}/valid", "--destdir", data,
                                                 "--joined-dictionary", "--workers", 1], f"{name}-preprocess.log"))
    return data


def logged(log: str, stat: str = "loss") -> Dict[str, float]:
    """A figure of fairseq-train's JSON log, in the log's order: the loss at each log interval and
    each validation, or another figure of the log intervals (such as fp16's loss_scale)."""
    figures = {}
    for kind, record in re.findall(r"\b(train_inner|valid)(?: \| |:)(\{.*\})", log):  # as formatted, or by default
        stats = json.loads(record)
        if kind == "train_inner" and stat in stats:
            figures[f"update {stats['num_updates']}"] = float(stats[stat])
        elif kind == "valid" and stat == "loss":
            figures[f"validation {stats['epoch']}"] = float(stats["valid_loss"])
    return figures


def largest_difference(graphed: Dict[str, float], eager: Dict[str, float]) -> Tuple[float, str]:
    """The largest difference between two runs' losses, and where."""
    if not graphed or graphed.keys() != eager.keys():
        raise StepFailed(f"the runs with and without graphs logged different losses: {sorted(graphed)} against "
                         f"{sorted(eager)}")
    return max((abs(graphed[point] - eager[point]), point) for point in graphed)


def graphs_in(log: str) -> Tuple[int, Optional[str]]:
    """The graphs a run captured, and the line saying why its graphs gave up (None: they did not)."""
    gave_up = re.findall(r".*: CUDA graph.*running eagerly from now on.*", log)
    return len(re.findall(r"captured graph \d+", log)), (gave_up[0].split(" | ")[-1] if gave_up else None)


def compare_training(graphed: str, eager: str, tolerance: float) -> Tuple[dict, List[str]]:
    """The figures of two fairseq-train logs, with graphs and without, and what is wrong with them: graphs
    that did not run, or ran where they were off; losses further apart than `tolerance`. In fp16, once
    the loss scalers part (an update whose gradients overflowed in one run and not in the other, skipped
    there alone), the runs part by chance: the losses are compared up to there."""
    captured, gave_up = graphs_in(graphed)
    losses = {"graphs": logged(graphed), "eager": logged(eager)}
    scales = {"graphs": logged(graphed, "loss_scale"), "eager": logged(eager, "loss_scale")}
    difference, where = largest_difference(losses["graphs"], losses["eager"])  # and that both logged the same
    parted = next((point for point, scale in scales["graphs"].items() if scales["eager"].get(point) != scale), None)
    compared = list(losses["graphs"])
    if parted is not None:
        compared = compared[:compared.index(parted)]
        if not compared:
            raise StepFailed(f"the loss scalers parted at {parted}, before a loss could be compared")
        difference, where = max((abs(losses["graphs"][point] - losses["eager"][point]), point) for point in compared)
    failures = []
    if gave_up:
        failures.append(f"the graphs gave up, so both runs were eager: {gave_up}")
    elif not captured:
        failures.append("no graph was captured")
    if graphs_in(eager)[0]:
        failures.append("--cuda-graphs off captured graphs")
    if difference > tolerance:
        failures.append(f"the losses with and without graphs differ by {difference:.3f} at {where} (graphs "
                        f"{losses['graphs'][where]:.3f}, eager {losses['eager'][where]:.3f}), more than the tolerance "
                        f"{tolerance:g}")
    return {"graphs captured": captured, "largest loss difference (bits/token)": difference, "at": where,
            "tolerance (bits/token)": tolerance, "points compared": len(compared), "loss scalers parted at": parted,
            "losses (bits/token)": losses}, failures


def training_comparison(check: Check) -> Outcome:
    """fairseq-train with graphs and without, in fp32 and fp16, the four side by side."""
    sizes = check.sizes["translation"]
    data = parallel_corpus(check, "translation", sizes["corpus"])
    updates = check.args.updates or sizes["updates"]
    common = [data, "--user-dir", PLUGIN, "--task", "translation", *sizes["model"], *sizes["batch"], "--optimizer",
              "adam", "--lr", "1e-3", "--max-update", updates, "--log-format", "json", "--log-interval",
              max(1, updates // 10), "--seed", 1, "--no-save", "--num-workers", 0]
    runs = {(precision, graphs): Command("fairseq_cli.train", [*common, "--cuda-graphs", graphs,
                                                               *check.device_flags(precision)],
                                         f"train-{precision}-graphs-{graphs}.log")
            for precision in LOSS_TOLERANCE for graphs in (check.graphs, "off")}
    check.run(*runs.values())
    figures, failures, rows = {}, [], []
    for precision in LOSS_TOLERANCE:
        graphed, eager = (read(check.path("logs", runs[precision, graphs].log)) for graphs in (check.graphs, "off"))
        figures[precision], found = compare_training(graphed, eager, check.tolerance(precision))
        failures += [f"{precision}: {failure}" for failure in found]
        found = figures[precision]
        losses, parted = found["losses (bits/token)"], found["loss scalers parted at"]
        last = [[point for point in losses["graphs"] if point.startswith(kind)][-1]
                for kind in ("update", "validation")]
        rows.append(f"| {precision} | {found['graphs captured']} | {found['points compared']}"
                    + (f", up to {parted}, where the loss scalers parted" if parted else "")
                    + f" | {found['largest loss difference (bits/token)']:.3f} | {found['at']} | "
                    f"{check.tolerance(precision):g} | "
                    + " | ".join(f"{losses['graphs'][point]:.3f} / {losses['eager'][point]:.3f}" for point in last)
                    + " |")
    model = " ".join(sizes["model"])
    outcome = Outcome(
        "largest loss difference with and without graphs: " + ", ".join(
            f"{figures[p]['largest loss difference (bits/token)']:.3f} ({p})" for p in figures) + " bits/token",
        figures,
        [f"On {check.machine['device']}, {updates} updates of `{model}`, `--cuda-graphs {check.graphs}` against "
         "`off` (the four runs side by side). Losses in bits per token, as fairseq logs them (3 decimals), at "
         "each log interval and each validation; in fp16, up to where the loss scalers part (an update skipped "
         "in one run alone), after which the runs part by chance.", "",
         "| precision | graphs captured | points compared | largest difference | at | tolerance "
         "| last train loss, graphs / eager | last valid loss, graphs / eager |",
         "|---|---:|---|---:|---|---:|---:|---:|", *rows])
    if failures:
        raise StepFailed("; ".join(failures), outcome)
    return outcome


# --- 3: the benchmark and fairseq-eval-lm -----------------------------------------------------------


def figure(column: str, value) -> str:
    """A cell of a benchmark's table: a share as a percentage, small figures to 2 decimals, others whole."""
    if value is None:
        return "-"
    return f"{value:.0%}" if column == "GPU busy" else f"{value:.2f}" if abs(value) < 10 else f"{value:,.0f}"


def rate_ratios(figures: Dict[str, Dict[str, float]], models: List[str]) -> Dict[str, Dict[str, float]]:
    """Each rate (a column in tokens per second) of the feedback model with graphs and without as a ratio
    to fairseq's model (models[0]), and graphs to eager, by the ratio's name."""
    fairseq, graphed, *eager = models
    pairs = {f"{graphed} / {fairseq}": (graphed, fairseq)}
    if eager:
        pairs.update({f"{eager[0]} / {fairseq}": (eager[0], fairseq), "graphs / eager": (graphed, eager[0])})
    return {ratio: {column: by_model[ours] / by_model[theirs] for column, by_model in figures.items()
                    if column.endswith("tok/s")} for ratio, (ours, theirs) in pairs.items()}


def benchmark(check: Check, only: str) -> Outcome:
    """feedback-benchmark --only `only` (translation, lm) in fp16."""
    sizes = check.sizes["benchmark"]
    written = check.path("work", f"benchmark-{only}.json")
    command = Command("fairseq_feedback_cli.benchmark", [
        "--only", only, "--preset", sizes["preset"], "--dtype", "fp16", "--device", check.args.device, "--cuda-graphs",
        check.graphs, "--first-batches", sizes["first_batches"], "--json", written], f"benchmark-{only}.log")
    check.run(command)
    with open(written) as f:
        table = json.load(f)["tables"][only]
    models, figures = table["models"], table["figures"]
    ratios = rate_ratios(figures, models)
    columns = [*figures, *table[NOT_MEASURED]]
    rows = [f"| {model} | " + " | ".join(NOT_MEASURED if column not in figures else
                                         figure(column, figures[column].get(model)) for column in columns) + " |"
            for model in models]
    rows += [f"| {ratio} | " + " | ".join(f"{by_column[column]:.2f}" if column in by_column else ""
                                          for column in columns) + " |" for ratio, by_column in ratios.items()]
    graphed = ratios[f"{models[1]} / {models[0]}"]
    first = next((column for column in figures if column.startswith("first")), None)
    summary = (f"feedback's training words/s {graphed['train tok/s']:.2f}x fairseq's with graphs"
               + (f", {ratios[f'{models[2]} / {models[0]}']['train tok/s']:.2f}x eagerly" if len(models) > 2 else "")
               + (f"; its first {sizes['first_batches']} batches at {graphed[first]:.2f}x" if first else "")
               + (f"; {figures['capture s/shape'][models[1]]:.2f} s per new shape" if "capture s/shape" in figures
                  else ""))
    outcome = Outcome(summary, table, [
        f"On {check.machine['device']}, fp16, `feedback-benchmark --preset {sizes['preset']}`: {table['title']}.", "",
        "tok/s: target tokens per second (fairseq's words/s), the median of steady calls; first N tok/s: over each "
        "model's first N training batches, every capture and first sighting included; capture s/shape: what a graphed "
        "model's first passes over those batches took beyond a steady pass, per graph captured; capture s: the "
        "steady workloads' calls that captured, beyond a steady call; MB: 2^20 bytes (peak: "
        "torch.cuda.max_memory_allocated as with the model alone on the GPU); ops/step or kernels/step: per target "
        "position of a training step; GPU busy: the share of a training step's wall time the GPU ran kernels.", "",
        "| model | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns), *rows])
    _, gave_up = graphs_in(read(check.path("logs", command.log)))
    if gave_up:  # the graphed rows are eager ones
        raise StepFailed(f"the graphs gave up: {gave_up}", outcome)
    return outcome


def text_corpus(check: Check, name: str, corpus: list) -> str:
    """The synthetic corpus's source side binarized as language-model text: its data directory."""
    raw, data = generated_corpus(check, name, corpus), check.path("work", name, "data-bin")
    check.run(Command("fairseq_cli.preprocess", ["--only-source", "--trainpref", f"{raw}/train.src", "--validpref",
                                                 f"{raw}/valid.src", "--destdir", data, "--workers", 1],
                      f"{name}-preprocess.log"))
    return data


def eval_lm(check: Check) -> Outcome:
    """fairseq-eval-lm's tokens/s at the benchmark's language-model size, in
    fp16, of feedback_lm with graphs and eagerly and of transformer_lm (each
    from a checkpoint of one update: the rate does not depend on the weights)."""
    sizes = check.sizes["eval_lm"]
    p = PRESETS[sizes["preset"]]["lm"]
    data = text_corpus(check, "lm", [*sizes["corpus"], "--vocab", p["vocab"] - 4])  # with fairseq's 4 symbols
    shape = ["--decoder-embed-dim", p["embed_dim"], "--decoder-ffn-embed-dim", p["ffn_dim"],
             "--decoder-attention-heads", p["heads"], "--decoder-layers", p["layers"], "--decoder-input-dim",
             p["embed_dim"], "--decoder-output-dim", p["embed_dim"]]
    blocks = ["--tokens-per-sample", p["block"], "--batch-size", p["streams"], "--num-workers", 0]
    task = {"feedback_lm": "feedback_language_modeling", "transformer_lm": "language_modeling"}
    options = {"feedback_lm": ["--memory-span", p["span"], "--cuda-graphs", "off",
                               *(["--head-dim", p["head_dim"]] if "head_dim" in p else [])],
               "transformer_lm": ["--decoder-normalize-before"]}
    checkpoint = {arch: check.path("work", "lm", arch, "checkpoint_last.pt") for arch in options}
    try:
        check.run(*[Command("fairseq_cli.train", [
            data, "--user-dir", PLUGIN, "--task", task[arch], "--arch", arch, *flags, *shape, *blocks,
            "--optimizer", "adam", "--lr", "1e-4", "--max-update", 1, "--save-dir", os.path.dirname(checkpoint[arch]),
            "--disable-validation", "--no-epoch-checkpoints", "--seed", 1, *check.device_flags()],
            f"eval-lm-checkpoint-{arch}.log") for arch, flags in options.items()])
        rates, losses, logs = {}, {}, {}
        for name, arch, graphs in (("feedback_lm", "feedback_lm", check.graphs),
                                   ("feedback_lm (eager)", "feedback_lm", "off"),
                                   ("transformer_lm", "transformer_lm", None)):
            command = Command("fairseq_cli.eval_lm", [
                data, "--user-dir", PLUGIN, "--task", task[arch], "--path", checkpoint[arch], "--gen-subset", "valid",
                *blocks, *check.device_flags("fp16"), *(["--model-overrides", json.dumps({"cuda_graphs": graphs})]
                                                       if graphs else [])],
                f"eval-lm-{name.replace(' (eager)', '-eager')}.log")
            check.run(command)  # one at a time: each rate is measured alone
            logs[name] = read(check.path("logs", command.log))
            evaluated = re.search(r"Evaluated [\d,]+ tokens in [\d.]+s \(([\d.]+) tokens/s\)", logs[name])
            loss = re.search(r"Loss \(base 2\): ([\d.]+)", logs[name])
            if not (evaluated and loss):
                raise StepFailed(f"fairseq-eval-lm printed no rate or loss for {name} (logs/{command.log})")
            rates[name], losses[name] = float(evaluated.group(1)), float(loss.group(1))
    finally:  # one-update checkpoints, of hundreds of MB at the full size
        for path in checkpoint.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    captured, gave_up = graphs_in(logs["feedback_lm"])
    difference = abs(losses["feedback_lm"] - losses["feedback_lm (eager)"])
    figures = {"tokens/s": rates, "loss (bits/token)": losses, "graphs captured": captured,
               "feedback_lm / transformer_lm": rates["feedback_lm"] / rates["transformer_lm"],
               "feedback_lm (eager) / transformer_lm": rates["feedback_lm (eager)"] / rates["transformer_lm"],
               "graphs / eager": rates["feedback_lm"] / rates["feedback_lm (eager)"]}
    outcome = Outcome(
        f"feedback_lm's tokens/s {figures['feedback_lm / transformer_lm']:.2f}x transformer_lm's with graphs, "
        f"{figures['feedback_lm (eager) / transformer_lm']:.2f}x eagerly", figures,
        [f"On {check.machine['device']}, fp16, `feedback-benchmark --preset {sizes['preset']}`'s language-model "
         f"size, {p['streams']} streams x blocks of {p['block']} tokens; fairseq-eval-lm's own figure, whose timer "
         "includes the graphs' capture.", "", "| model | tokens/s | loss (bits/token) |", "|---|---:|---:|",
         *[f"| {name} | {rates[name]:,.0f} | {losses[name]:.4f} |" for name in rates], "",
         f"Ratios: feedback_lm with graphs / transformer_lm {figures['feedback_lm / transformer_lm']:.2f}, eager / "
         f"transformer_lm {figures['feedback_lm (eager) / transformer_lm']:.2f}, graphs / eager "
         f"{figures['graphs / eager']:.2f}."])
    if gave_up or not captured:
        raise StepFailed(f"fairseq-eval-lm with graphs ran eagerly: {gave_up or 'no graph was captured'}", outcome)
    if difference > check.tolerance("fp16"):
        raise StepFailed(f"fairseq-eval-lm's loss with graphs ({losses['feedback_lm']}) and eagerly "
                         f"({losses['feedback_lm (eager)']}) differ by more than {check.tolerance('fp16'):g}", outcome)
    return outcome


# --- 4: two ranks -----------------------------------------------------------------------------------


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def checkpoint_parameters(path: str) -> dict:
    import logging

    import torch

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # what fairseq's import logs is no progress line
    from fairseq_feedback.safe_checkpoints import fairseq_checkpoints_allowed

    with fairseq_checkpoints_allowed():
        return torch.load(path, map_location="cpu")["model"]


def two_ranks(check: Check) -> Outcome:
    """Two ranks of a batch each, and one rank of both batches (16
    sentences: one update is an epoch, so each update sees the same
    sentences either way), with graphs on and SGD (Adam would turn the float
    noise of gradients that are zero in exact arithmetic into full steps)."""
    sizes = check.sizes["two_ranks"]
    data = parallel_corpus(check, "two-ranks", ["--train", 2 * sizes["batch"], "--valid", 1, "--seed", 2])
    if check.on_cpu:
        backend, devices, where = "gloo", [None, None], "gloo on the CPU"
    elif gpus() >= 2:
        backend, devices, where = "nccl", [0, 1], "NCCL on GPUs 0 and 1"
    else:
        backend, devices, where = "gloo", [0, 0], "gloo, both ranks on GPU 0, the only GPU"
    common = [data, "--user-dir", PLUGIN, "--task", "translation", *sizes["model"], "--optimizer", "sgd", "--lr", 0.25,
              "--required-batch-size-multiple", 1, "--max-update", sizes["updates"], "--ddp-backend", "legacy_ddp",
              "--cuda-graphs", check.graphs, "--disable-validation", "--no-epoch-checkpoints", "--log-format", "json",
              "--log-interval", 1, "--seed", 1, "--num-workers", 0, *check.device_flags()]
    save = {count: check.path("work", "two-ranks", f"{count}-rank") for count in (1, 2)}
    one = Command("fairseq_cli.train", [*common, "--batch-size", 2 * sizes["batch"], "--save-dir", save[1]],
                  "two-ranks-one-rank.log")
    ranks = [Command("fairseq_cli.train", [*common, "--batch-size", sizes["batch"], "--save-dir", save[2],
                                           "--distributed-world-size", 2, "--distributed-rank", rank,
                                           "--distributed-backend", backend, "--distributed-init-method",
                                           f"file://{check.path('work', 'two-ranks', 'rendezvous')}",
                                           "--distributed-no-spawn",
                                           *([] if device is None else ["--device-id", device])],
                     f"two-ranks-rank{rank}.log") for rank, device in enumerate(devices)]
    check.run(one, *ranks)
    logs = [read(check.path("logs", command.log)) for command in (one, *ranks)]
    if "training on 2 devices" not in logs[1]:
        raise StepFailed(f"the two ranks did not train as one job (logs/{ranks[0].log})")
    expected, got = (checkpoint_parameters(os.path.join(save[count], "checkpoint_last.pt")) for count in (1, 2))
    if got.keys() != expected.keys():
        raise StepFailed("two ranks saved other parameters than one rank")
    gaps = {name: (got[name].float() - expected[name].float()).abs() for name in expected}
    beyond = [name for name in expected if (gaps[name] > PARAMETER_TOLERANCE["atol"] + PARAMETER_TOLERANCE["rtol"]
                                            * expected[name].float().abs()).any()]
    largest = max(gap.max().item() for gap in gaps.values())
    loss_difference, at = largest_difference(logged(logs[1]), logged(logs[0]))
    captured = [graphs_in(log)[0] for log in logs[:2]]  # rank 1 logs warnings only, as fairseq's ranks do
    figures = {"backend": backend, "where": where, "batch per rank (sentences)": sizes["batch"],
               "updates": sizes["updates"], "largest parameter difference": largest,
               "tolerance": PARAMETER_TOLERANCE, "largest loss difference (bits/token)": loss_difference,
               "graphs captured (one rank, rank 0 of two)": captured,
               "NCCL": "used" if backend == "nccl" else f"{NOT_MEASURED} ({where})"}
    outcome = Outcome(
        f"{where}: parameters within {largest:.1e} of one rank's with twice the batch", figures,
        [f"On {check.machine['device']}, {where}: two ranks of {sizes['batch']} sentences each against one rank "
         f"of {2 * sizes['batch']}, {sizes['updates']} updates of SGD, `--cuda-graphs {check.graphs}`, "
         "`--ddp-backend legacy_ddp`.", "", "| | |", "|---|---|",
         f"| largest parameter difference | {largest:.2e} (allowed: {PARAMETER_TOLERANCE['atol']:g} + "
         f"{PARAMETER_TOLERANCE['rtol']:g} x the parameter) |",
         f"| largest loss difference | {loss_difference:.3f} bits/token at {at} |",
         f"| graphs captured: one rank, rank 0 of two | {', '.join(map(str, captured))} |",
         f"| NCCL | {figures['NCCL']} |"])
    if not all(captured):
        raise StepFailed(f"a run captured no graph (one rank, rank 0 of two: {captured})", outcome)
    if beyond:
        raise StepFailed("two ranks' parameters differ from one rank's with twice the batch: "
                         + ", ".join(f"{name} by {gaps[name].max().item():.2e}" for name in beyond), outcome)
    return outcome


PARTS = {1: "The GPU tests", 2: "Training with and without graphs", 3: "The benchmark", 4: "Two ranks"}
STEPS = [
    Step("1", "the GPU tests (pytest -m gpu)", {"full": 75, "tiny": 8}, gpu_tests),
    Step("2", "fairseq-train with graphs and without, fp32 and fp16", {"full": 55, "tiny": 30}, training_comparison),
    Step("3a", "feedback-benchmark, translation, fp16", {"full": 100, "tiny": 10},
         lambda check: benchmark(check, "translation")),
    Step("3b", "feedback-benchmark, language model, fp16", {"full": 75, "tiny": 10},
         lambda check: benchmark(check, "lm")),
    Step("3c", "fairseq-eval-lm, language model, fp16", {"full": 50, "tiny": 30}, eval_lm),
    Step("4", "two ranks against one with twice the batch", {"full": 40, "tiny": 20}, two_ranks),
]


def run_step(check: Check, step: Step) -> None:
    """The step, or why not, recorded; a progress line as it starts and as it ends; the report rewritten."""
    estimate = step.estimate[check.args.size]
    record = check.begin(step)
    if step.part not in check.args.parts:
        record.update(status=NOT_RUN, summary="not asked for (--parts)")
    elif estimate > check.left():
        record.update(status=SKIPPED, summary=f"needs about {estimate:.0f} s, {max(0, check.left()):.0f} s were "
                                              f"left of --minutes {check.args.minutes:g}")
    else:
        print(f"[{step.key}] {step.title} (about {estimate:.0f} s; {check.left() / 60:.1f} min left) ...", flush=True)
        check.write_report()
        started = time.monotonic()
        try:
            outcome = step.run(check)
            record.update(status=outcome.status, summary=outcome.summary, figures=outcome.figures,
                          markdown=outcome.markdown)
        except StepFailed as failure:
            record.update(status=FAILED, summary=str(failure), figures=failure.outcome.figures,
                          markdown=failure.outcome.markdown)
        except OutOfTime:
            record.update(status=STOPPED, summary=f"stopped at the deadline of --minutes {check.args.minutes:g}")
        except Exception as error:  # a bug of this check: said, and the other steps still run
            with open(check.path("logs", f"step-{step.key}-traceback.log"), "w") as log:
                traceback.print_exc(file=log)
            record.update(status=FAILED, summary=f"{type(error).__name__}: {error} "
                                                 f"(logs/step-{step.key}-traceback.log)")
        finally:
            record["seconds"] = round(time.monotonic() - started, 1)
    took = "" if record["status"] in (NOT_RUN, SKIPPED) else f" in {record['seconds']:.0f} s"
    print(f"[{step.key}] {record['status']}{took}: {record['summary']}", flush=True)
    check.write_report()


# --- the machine ------------------------------------------------------------------------------------


def output_of(*command: str) -> str:
    """What `command` prints; nothing where it is missing, fails or hangs."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def nvidia_smi_gpus(text: str) -> List[dict]:
    """The GPUs of `nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader`."""
    keys = ("name", "driver", "memory", "compute mode")
    return [dict(zip(keys, (cell.strip() for cell in line.split(",")))) for line in text.splitlines() if line.strip()]


def describe_machine(device: str) -> dict:
    """The card(s), the driver, torch and CUDA, and the rest of what the figures were measured on."""
    import torch

    def version(*distributions):
        for distribution in distributions:
            try:
                return importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "unknown"

    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = re.findall(r"model name\s*:\s*(.*)", read("/proc/cpuinfo"))
        cpu = names[0] if names else cpu
    commit = ""
    if os.path.exists(os.path.join(REPO, ".git")):
        head = output_of("git", "-C", REPO, "rev-parse", "--short", "HEAD").strip()
        changed = output_of("git", "-C", REPO, "status", "--porcelain", "--untracked-files=no").strip()
        commit = f", commit {head}" + (" with local changes" if changed else "") if head else ""
    machine = {"device": f"CPU: {cpu}, {os.cpu_count()} cores", "gpus": []}
    if device == "cuda":
        gpus = nvidia_smi_gpus(output_of("nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_mode",
                                         "--format=csv,noheader"))
        # CUDA only, from here
        gpus = gpus or [{"name": torch.cuda.get_device_name(i)} for i in range(torch.cuda.device_count())]
        machine = {"device": gpus[0]["name"] + (f" (1 of {len(gpus)} GPUs)" if len(gpus) > 1 else ""), "gpus": gpus,
                   "driver": gpus[0].get("driver", "unknown"), "GPU memory": gpus[0].get("memory", "unknown"),
                   "compute mode": gpus[0].get("compute mode", "unknown")}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {**machine, "CUDA (torch's build)": torch.version.cuda or "none (a CPU build of torch)",
            "cuDNN": cudnn or "none", "torch": torch.__version__, "fairseq": version("fairseq-fixed", "fairseq"),
            "fairseq-feedback": version("fairseq-feedback") + commit, "Python": platform.python_version(),
            "CPU": f"{cpu}, {os.cpu_count()} cores", "OS": platform.platform()}


# --- the command ------------------------------------------------------------------------------------


def check_replaceable(out) -> None:
    if os.path.exists(out) and not (os.path.isdir(out) and (os.path.exists(os.path.join(out, MARKER))
                                                             or not os.listdir(out))):
        fail(f"{out} exists and is not a folder this check wrote: pass another --out")


def parts(text: str) -> List[int]:
    if not set(text.split(",")) <= {"1", "2", "3", "4"}:
        raise argparse.ArgumentTypeError(f"the parts are 1, 2, 3 and 4, as in 1,2,3,4; got {text!r}")
    return sorted({int(part) for part in text.split(",")})


def main(argv=None):
    parser = ArgumentParser(prog="feedback-gpu-check", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the report's folder (default: a new gpu-check-DATE-TIME here); a previous "
                                      "check's folder is replaced when this one ends")
    parser.add_argument("--minutes", type=float, default=8.0,
                        help="the time it may take (default 8, what the full sizes need on one H100); a step "
                             "that would not fit in what is left is skipped for time")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default); cpu runs the same sequence at tiny sizes, the graphs through the "
                             "stand-in for capture (--cuda-graphs emulate)")
    parser.add_argument("--cuda-graphs", choices=["auto", "emulate"],
                        help="the runs with graphs on: auto (default on cuda), or emulate, the graphs' path with a "
                             "stand-in for the CUDA calls (default on cpu, where auto runs no graphs)")
    parser.add_argument("--size", choices=sorted(SIZES), help="full (default on cuda) or tiny (default on cpu)")
    parser.add_argument("--parts", type=parts, default=[1, 2, 3, 4],
                        help="run only these parts, e.g. 2,3 (default 1,2,3,4)")
    parser.add_argument("--updates", type=int,
                        help="fairseq-train's updates in part 2 (default: 200 at the full size, 20 at tiny)")
    parser.add_argument("--tolerance", type=float, help="the largest difference allowed between losses with and "
                                                        "without graphs, in bits per token (default: "
                                                        + ", ".join(f"{v:g} in {k}" for k, v in LOSS_TOLERANCE.items())
                                                        + ")")
    args = parser.parse_args(argv)
    check_at_least(args, updates=1)
    if args.minutes <= 0 or (args.tolerance is not None and args.tolerance < 0):
        fail("--minutes must be above 0 and --tolerance 0 or above")
    args.cuda_graphs = args.cuda_graphs or ("auto" if args.device == "cuda" else "emulate")
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"no CUDA GPU is visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}): install a CUDA "
             "build of torch, or pass --device cpu for the tiny run on the CPU")
    if args.device == "cpu" and args.cuda_graphs == "auto":
        fail("--cuda-graphs auto runs no graphs on the CPU: pass --cuda-graphs emulate")
    out = os.path.abspath(args.out or datetime.datetime.now().strftime("gpu-check-%Y%m%d-%H%M%S"))
    command = ["feedback-gpu-check", *(sys.argv[1:] if argv is None else argv)]
    machine = describe_machine(args.device)

    def terminated(signum, frame):  # as Ctrl-C: the commands are stopped and the report says so
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        run_all(args, out, machine, command)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_all(args, out: str, machine: dict, command: List[str]) -> None:
    """Every step, into `out`; a last line saying how it went, and the exit status."""
    cuda = machine["CUDA (torch's build)"]
    print(f"feedback-gpu-check: {machine['device']}, torch {machine['torch']}, CUDA {cuda}; {args.minutes:g} minutes; "
          f"the report in {out}.tmp until it ends, then in {out}", flush=True)
    with atomic_folder(out, check=check_replaceable) as building:
        open(building / MARKER, "w").close()
        check = Check(args, str(building), out, machine, command)
        try:
            for step in STEPS:
                run_step(check, step)
            check.status = {0: "passed", 1: "failed", 2: "incomplete"}[check.exit_status()]
        except KeyboardInterrupt:
            interrupted = check.record
            interrupted.update(status=INTERRUPTED, summary="interrupted")
            for step in STEPS[len(check.records):]:
                check.begin(step).update(status=NOT_RUN, summary="not run: the check was interrupted")
            check.status = "interrupted"
        check.write_report()
    minutes = (time.monotonic() - check.started) / 60
    report = os.path.join(out, "report.md")
    if check.status == "interrupted":
        fail(f"interrupted during step {interrupted['step']}; {report} says what ran")
    if check.status == "failed":
        failed = [f"{record['step']} ({record['title']}: {record['summary']})" for record in check.records
                  if record["status"] == FAILED]
        fail(f"failed in {minutes:.1f} min: step {'; step '.join(failed)}; the report: {report}")

    def steps(*statuses) -> str:
        return ", ".join(record["step"] for record in check.records if record["status"] in statuses)

    print(f"feedback-gpu-check: {check.status} in {minutes:.1f} min: passed {steps(PASSED) or 'none'}"
          + (f"; skipped or stopped for time: {steps(SKIPPED, STOPPED)} (--minutes {args.minutes:g})"
             if steps(SKIPPED, STOPPED) else "") + (f"; not run: {steps(NOT_RUN)}" if steps(NOT_RUN) else "")
          + f"; the report: {report}", flush=True)
    sys.exit(check.exit_status())


if __name__ == "__main__":
    main()
