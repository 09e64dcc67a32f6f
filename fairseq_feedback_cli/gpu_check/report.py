"""The report of a run as it stands: report.json (every figure, with the machine and the options)
and report.md (a table of the steps, then a section for each, under its part's heading), each
replaced whole as a step starts and as it ends; until the run ends, report.md's first line says
that it is running."""

import json
import shlex
import time

from ..outputs import atomic_file
from .check import FAILED, INTERRUPTED, Check

PARTS = {1: "The GPU tests", 2: "Training with and without graphs", 3: "The benchmark", 4: "Two ranks"}


def write_report(check: Check) -> None:
    """report.md and report.json as the run stands, each replaced whole."""
    seconds = time.monotonic() - check.started
    steps = [{k: v for k, v in record.items() if k != "markdown"} for record in check.records]
    with atomic_file(check.path("report.json")) as f:
        json.dump({"status": check.status, "exit status": None if check.status == "running" else check.exit_status(),
                   "date": check.date, "command": check.command, "options": vars(check.args),
                   "seconds": round(seconds, 1), "machine": check.machine, "steps": steps}, f, indent=1)
    with atomic_file(check.path("report.md")) as f:
        f.write(markdown(check, seconds))


def headline(check: Check) -> str:
    if check.status == "running":
        return (f"RUNNING (step {check.record['step'] if check.record else '-'}; this report is rewritten after "
                "each step, and says it is finished when it is)")
    failed = [record["step"] for record in check.records if record["status"] in (FAILED, INTERRUPTED)]
    return check.status.upper() + (f": {', '.join(failed)}" if failed else "")


def markdown(check: Check, seconds: float) -> str:
    lines = [f"# feedback-gpu-check: {headline(check)}", "",
             f"{check.date}, `{shlex.join(check.command)}`: {seconds / 60:.1f} of {check.args.minutes:g} minutes "
             f"on {check.machine['device']}; sizes {check.args.size}, graphs `--cuda-graphs {check.graphs}`.", "",
             "## Machine", "", "| | |", "|---|---|",
             *[f"| {key} | {value} |" for key, value in check.machine.items() if key != "gpus"], "",
             "## Steps", "", "| step | what | status | seconds (estimate) | result |", "|---|---|---|---:|---|"]
    for record in check.records:
        took = "" if record["seconds"] is None else f"{record['seconds']:.0f}"
        lines.append(f"| {record['step']} | {record['title']} | {record['status']} | "
                     f"{took} ({record['estimate seconds']:.0f}) | {record['summary']} |")
    part = None
    for record in check.records:
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
