"""feedback-gpu-check: the CUDA-graph path checked and measured on a GPU, in one command.

    feedback-gpu-check --out gpu-check                       # on a GPU, from a checkout: 13 minutes or less
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
     peak GPU memory); 3c fairseq-eval-lm's tokens/s at the language-model size; 3d, 3e
     feedback-benchmark --rows at both sizes: speed against rows (translation 256 and 1,024
     sentences a batch, the language model 32, 128 and 512 streams, and in 3e the language
     model also trained in passes, --train-passes 4 --pass-group 16, beside exact feedback),
     each model at its fastest batch within the GPU's memory and its ratio to fairseq's,
     and the exact feedback model's training step profiled kernel by kernel at the smallest
     and largest batch;
  4  two ranks with graphs on (NCCL on two GPUs; gloo sharing one GPU, or on the CPU) against
     one rank with twice the batch: the same parameters after a few updates.

A step that would not fit in what is left of --minutes (by its estimate) is skipped for time,
and one still running at the deadline is stopped; the report says which. The report
(report.md), every figure with the machine (report.json) and each command's output (logs/)
are written into OUT.tmp beside --out, where report.md says how far the run has got, and
OUT.tmp becomes OUT when the run ends. Exit status: 0 when every step asked for passed;
1 when one failed (the last line names it); 2 when none failed but some were skipped or
stopped for time, or ran without what they check happening (not judged: part 2 with too few
--updates for a batch shape to come twice). How to read the report: docs/gpu-check.md.
"""

import argparse
import datetime
import math
import os
import signal
import sys
import time
import traceback
from typing import List

from ..command_line import ArgumentParser, check_at_least, command, fail
from ..outputs import atomic_folder, check_destination
from .check import (FAILED, INTERRUPTED, NOT_JUDGED, NOT_RUN, PASSED, SKIPPED, STOPPED, Check, OutOfTime, Step,
                    StepFailed)
from .gpu_tests import gpu_tests
from .machine import describe_machine
from .report import write_report
from .sizes import LOSS_TOLERANCE, SIZES
from .speed import benchmark, eval_lm, rows_sweep
from .training import training_comparison
from .two_ranks import two_ranks

MARKER = ".feedback-gpu-check"  # marks a folder this check wrote (and may replace)

STEPS = [
    Step("1", "the GPU tests (pytest -m gpu)", {"full": 110, "tiny": 8}, gpu_tests),
    Step("2", "fairseq-train with graphs and without, fp32 and fp16", {"full": 46, "tiny": 30}, training_comparison),
    Step("3a", "feedback-benchmark, translation, fp16", {"full": 70, "tiny": 10},
         lambda check: benchmark(check, "translation")),
    Step("3b", "feedback-benchmark, language model, fp16", {"full": 135, "tiny": 10},
         lambda check: benchmark(check, "lm")),
    Step("3c", "fairseq-eval-lm, language model, fp16", {"full": 95, "tiny": 30}, eval_lm),
    # full: from the H100's steps of 2026-11-27 (translation 68 ms at 256 x 32 and 1.8 s per shape
    # captured; the LM 325 ms a block of 32 streams and 6.8 s per shape), each batch's warm-up, 5 steps
    # of each model, the count and the profile, a step's time taken to grow with its rows at worst;
    # 3e's model trained in passes (eager, not profiled): a third more, a guess until a GPU measures
    # it (tiny: a quarter more, as measured on the CPU)
    Step("3d", "feedback-benchmark --rows, translation, fp16", {"full": 60, "tiny": 15},
         lambda check: rows_sweep(check, "translation")),
    Step("3e", "feedback-benchmark --rows, language model, exact and in passes, fp16", {"full": 260, "tiny": 18},
         lambda check: rows_sweep(check, "lm")),
    Step("4", "two ranks against one with twice the batch", {"full": 32, "tiny": 20}, two_ranks),
]


def run_step(check: Check, step: Step) -> None:
    """The step, or why not, recorded; a progress line as it starts and as it ends; the report rewritten."""
    estimate = step.estimate[check.args.size]
    record = check.begin(step)
    if step.part not in check.args.parts and step.key not in check.args.parts:
        record.update(status=NOT_RUN, summary="not asked for (--parts)")
    elif estimate > check.left():
        record.update(status=SKIPPED, summary=f"needs about {estimate:.0f} s, {max(0, check.left()):.0f} s were "
                                              f"left of --minutes {check.args.minutes:g}")
    else:
        print(f"[{step.key}] {step.title} (about {estimate:.0f} s; {check.left() / 60:.1f} min left) ...", flush=True)
        write_report(check)
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
    write_report(check)


def check_replaceable(out) -> None:
    if os.path.exists(out) and not (os.path.isdir(out) and (os.path.exists(os.path.join(out, MARKER))
                                                             or not os.listdir(out))):
        fail(f"{out} exists and is not a folder this check wrote: pass another --out")


def parts(text: str) -> List:
    """Parts (1, 2, 3, 4) as numbers, and steps of a part (3d) as their keys."""
    keys = {step.key for step in STEPS}
    if not set(text.split(",")) <= {"1", "2", "3", "4"} | keys:
        raise argparse.ArgumentTypeError(f"the parts are 1, 2, 3 and 4, as in 1,2,3,4, and a part's steps are "
                                         f"{', '.join(sorted(keys - {'1', '2', '4'}))}; got {text!r}")
    chosen = set(text.split(","))
    return sorted(int(part) for part in chosen if part.isdigit()) + sorted(key for key in chosen if not key.isdigit())


@command
def main(argv=None):
    parser = ArgumentParser(prog="feedback-gpu-check", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the report's folder (default: a new gpu-check-DATE-TIME here); a previous "
                                      "check's folder is replaced when this one ends")
    parser.add_argument("--minutes", type=float, default=13.0,
                        help="the time it may take (default 13, what the full sizes need on one H100; inf: no "
                             "limit); a step that would not fit in what is left is skipped for time")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default); cpu runs the same sequence at tiny sizes, the graphs through the "
                             "stand-in for capture (--cuda-graphs emulate)")
    parser.add_argument("--cuda-graphs", choices=["auto", "emulate"],
                        help="the runs with graphs on: auto (default on cuda), or emulate, the graphs' path with a "
                             "stand-in for the CUDA calls (default on cpu, where auto runs no graphs)")
    parser.add_argument("--size", choices=sorted(SIZES), help="full (default on cuda) or tiny (default on cpu)")
    parser.add_argument("--parts", type=parts, default=[1, 2, 3, 4],
                        help="run only these parts, e.g. 2,3, or steps of a part, e.g. 3d,3e (default 1,2,3,4)")
    parser.add_argument("--updates", type=int,
                        help="fairseq-train's updates in part 2 (default: 100 at the full size, 20 at tiny)")
    parser.add_argument("--tolerance", type=float, help="the largest difference allowed between losses with and "
                                                        "without graphs, in bits per token (default: "
                                                        + ", ".join(f"{v:g} in {k}" for k, v in LOSS_TOLERANCE.items())
                                                        + ")")
    args = parser.parse_args(argv)
    check_at_least(args, updates=1)
    # nan compares false with everything: taken, it skipped every step (--minutes) or passed every loss (--tolerance)
    if math.isnan(args.minutes) or args.minutes <= 0:
        fail(f"--minutes must be a number above 0 (inf: no limit), got {args.minutes:g}")
    if args.tolerance is not None and not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        fail(f"--tolerance must be a number, 0 or above, got {args.tolerance:g}")
    args.cuda_graphs = args.cuda_graphs or ("auto" if args.device == "cuda" else "emulate")
    args.size = args.size or ("full" if args.device == "cuda" else "tiny")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail(f"no CUDA GPU is visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}): install a CUDA "
             "build of torch, or pass --device cpu for the tiny run on the CPU")
    if args.device == "cpu" and args.cuda_graphs == "auto":
        fail("--cuda-graphs auto runs no graphs on the CPU: pass --cuda-graphs emulate")
    out = os.path.abspath(args.out or datetime.datetime.now().strftime("gpu-check-%Y%m%d-%H%M%S"))
    check_destination(out, "--out", folder=True)
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
        write_report(check)
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
             if steps(SKIPPED, STOPPED) else "") + (f"; not judged: {steps(NOT_JUDGED)}" if steps(NOT_JUDGED) else "")
          + (f"; not run: {steps(NOT_RUN)}" if steps(NOT_RUN) else "")
          + f"; the report: {report}", flush=True)
    sys.exit(check.exit_status())
