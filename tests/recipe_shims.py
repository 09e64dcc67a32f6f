"""Stand-ins for the commands the recipes in examples/*/README.md call, for tests/test_recipes.py.

tests/test_recipes.py runs the README's shell blocks as they are, with a
folder of these stand-ins first on PATH. Each runs the real tool (fairseq's
CLI function, or this project's console-script function named in setup.py)
in its own process, on the command line it was given, after three CPU-only
changes taken from $RECIPE_OVERRIDES, a JSON object {tool: {"drop": [...],
"set": {option: value}, "add": [...]}}:

- "drop": flags removed (--fp16: fairseq trains in half precision on CUDA only);
- "set": options the command has are given another value, appended so that
  argparse's last-one-wins applies (a few updates instead of 50,000, tiny
  batches and blocks);
- "add": options appended always (--cpu, the tiny model's sizes).

Multi-GPU launches become two CPU workers talking over gloo, as fairseq
itself cannot on CPU: `fairseq-train --distributed-world-size N` (fairseq's
own spawn, which needs N GPUs) starts two processes with explicit ranks,
which meet through a file, and under torchrun (the `torchrun` stand-in caps
--nproc_per_node at 2) each rank gets torchrun's RANK and WORLD_SIZE as
explicit options, since fairseq divides by the number of GPUs to find its
device. Every call is appended to $RECIPE_CALLS (JSON lines: the tool, the
command line as written and as run, and how many GPUs it asked for) for
the test to check.
"""

import importlib
import json
import os
import subprocess
import sys
import tempfile

FAIRSEQ = {
    "fairseq-preprocess": "fairseq_cli.preprocess",
    "fairseq-train": "fairseq_cli.train",
    "fairseq-generate": "fairseq_cli.generate",
    "fairseq-eval-lm": "fairseq_cli.eval_lm",
}
MAX_WORKERS = 2
GLOO = ["--distributed-no-spawn", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]


def _has(argv, option):
    return any(a == option or a.startswith(option + "=") for a in argv)


def _value(argv, option):
    value = None
    for i, a in enumerate(argv):
        if a == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(option + "="):
            value = a.split("=", 1)[1]
    return value


def adjust(tool, argv):
    spec = json.loads(os.environ.get("RECIPE_OVERRIDES", "{}")).get(tool, {})
    argv = [a for a in argv if a not in spec.get("drop", [])]
    for option, value in spec.get("set", {}).items():
        if _has(argv, option):
            argv += [option, str(value)]
    return argv + [str(a) for a in spec.get("add", [])]


def log_call(tool, written, run, **extra):
    path = os.environ.get("RECIPE_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"tool": tool, "written": written, "run": run, **extra}) + "\n")


def run(tool, argv, module, function):
    """The tool on argv, in this process, as its console script runs it."""
    sys.argv = [tool, *argv]
    sys.exit(getattr(importlib.import_module(module), function)())


def spawn_workers(argv, workers):
    """What fairseq's spawn does with N GPUs, on CPU: one process per rank."""
    with tempfile.TemporaryDirectory() as meeting:
        ranks = [subprocess.Popen([sys.executable, "-m", FAIRSEQ["fairseq-train"], *argv,
                                   "--distributed-world-size", str(workers), "--distributed-rank", str(r),
                                   "--distributed-init-method", f"file://{meeting}/workers", *GLOO])
                 for r in range(workers)]
        return max(rank.wait() for rank in ranks)


def fairseq_tool(tool):
    written = sys.argv[1:]
    argv = adjust(tool, written)
    gpus = 1
    if tool == "fairseq-train":
        if "RANK" in os.environ:  # a rank started by torchrun
            gpus = int(os.environ.get("RECIPE_TORCHRUN_NPROC", os.environ["WORLD_SIZE"]))
            argv += ["--distributed-init-method", "env://", "--distributed-world-size", os.environ["WORLD_SIZE"],
                     "--distributed-rank", os.environ["RANK"], *GLOO]
        elif int(_value(written, "--distributed-world-size") or 1) > 1:
            gpus = int(_value(written, "--distributed-world-size"))
            log_call(tool, written, argv, gpus=gpus, workers=min(gpus, MAX_WORKERS))
            sys.exit(spawn_workers(argv, min(gpus, MAX_WORKERS)))
    if os.environ.get("RANK", "0") == "0":
        log_call(tool, written, argv, gpus=gpus)
    run(tool, argv, FAIRSEQ[tool], "cli_main")


def torchrun():
    """torchrun with at most MAX_WORKERS processes per node; what comes after the script is left alone."""
    written, argv, nproc = sys.argv[1:], [], None
    i = 0
    while i < len(written):
        a = written[i]
        if os.path.isfile(a):  # the script: the rest is its command line
            argv += written[i:]
            break
        name, _, inline = a.partition("=")
        if name in ("--nproc_per_node", "--nproc-per-node"):
            nproc = inline or written[i + 1]
            argv += [name, str(min(int(nproc), MAX_WORKERS))]
            i += 1 if inline else 2
            continue
        argv.append(a)
        i += 1
    log_call("torchrun", written, argv, gpus=int(nproc or 1))
    os.environ["RECIPE_TORCHRUN_NPROC"] = str(nproc or 1)
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])


def entry_point(tool, module, function):
    """A console script of setup.py, as pip would install it."""
    written = sys.argv[1:]
    argv = adjust(tool, written)
    log_call(tool, written, argv)
    run(tool, argv, module, function)


def main(tool):
    if tool == "torchrun":
        torchrun()
    else:
        fairseq_tool(tool)
