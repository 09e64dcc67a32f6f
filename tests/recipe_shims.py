"""Stand-ins for the commands the recipes in examples/*/README.md call, for tests/test_recipes.py
(and for examples/results/cpu_tier.sh, in tests/test_cpu_tier.py, with no changes; and for the
two-worker training of helpers.train_on_two_workers).

tests/test_recipes.py runs the README's shell blocks as they are, with a
folder of these stand-ins first on PATH. Each runs the real tool (fairseq's
CLI function, or this project's console-script function named in setup.py)
in its own process, on the command line it was given, after three CPU-only
changes taken from $RECIPE_OVERRIDES, a JSON object {tool: {"drop": [...],
"set": {option: value}, "add": [...]}}:

- "drop": flags removed (--fp16: fairseq trains in half precision on CUDA only);
- "set": options the command has are given another value, appended so that
  argparse's last-one-wins applies (a few updates instead of 50,000, tiny
  batches and blocks); a fairseq-train whose --save-dir holds
  checkpoint_last.pt continues it (a finetuning), and its "set" --max-update
  counts the updates it adds to the checkpoint's, so that it trains as many
  again (its call's "continued" says from how many updates);
- "add": options appended always (--cpu, the tiny model's sizes);
- "workers" (fairseq-train only): at most this many CPU workers for a
  multi-GPU launch (default 2; 1 where a recipe's other tests run two).

Multi-GPU launches become two CPU workers talking over gloo, as fairseq
itself cannot on CPU: `fairseq-train --distributed-world-size N` (fairseq's
own spawn, which needs N GPUs; a command that names its --distributed-rank
is one rank already, and runs as it is) starts two processes with explicit ranks,
which meet through a file, and under torchrun (the `torchrun` stand-in caps
--nproc_per_node at 2) each rank gets torchrun's RANK and WORLD_SIZE as
explicit options, since fairseq divides by the number of GPUs to find its
device. Every call is appended to $RECIPE_CALLS (JSON lines: the tool, the
command line as written and as run, and how many GPUs it asked for) for
the test to check.

Importing torch and fairseq takes about 3 s of CPU, most of what a command
costs at these sizes, and a recipe runs dozens. With $RECIPE_SERVER set
(the socket of serve(), started by the test) a stand-in does not import
them: it hands its command line, environment, folder and stdin/stdout/stderr
to the server, which imported them once and forks a process that runs the
command as the stand-in would have, and it exits with that process's status.
The server also imports what torch imports on first use in nearly every
command (torch._dynamo, and with it sympy, as an optimizer is built or a
shape checked): half of what a training command cost after the fork.
"""

import argparse
import contextlib
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

FAIRSEQ = {
    "fairseq-preprocess": "fairseq_cli.preprocess",
    "fairseq-train": "fairseq_cli.train",
    "fairseq-generate": "fairseq_cli.generate",
    "fairseq-eval-lm": "fairseq_cli.eval_lm",
}
MAX_WORKERS = 2
TESTS = os.path.dirname(os.path.abspath(__file__))
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


def overrides(tool):
    return json.loads(os.environ.get("RECIPE_OVERRIDES", "{}")).get(tool, {})


def adjust(tool, argv):
    spec = overrides(tool)
    argv = [a for a in argv if a not in spec.get("drop", [])]
    for option, value in spec.get("set", {}).items():
        if _has(argv, option):
            argv += [option, str(value)]
    return argv + [str(a) for a in spec.get("add", [])]


def continued_updates(argv):
    """The updates in checkpoint_last.pt of a fairseq-train command's --save-dir, or None when it has none or
    its "set" does not replace --max-update."""
    last = os.path.join(_value(argv, "--save-dir") or "checkpoints", "checkpoint_last.pt")
    if "--max-update" not in overrides("fairseq-train").get("set", {}) or not _has(argv, "--max-update") \
            or not os.path.exists(last):
        return None
    from fairseq import checkpoint_utils, utils

    # fairseq-train imports its --user-dir first too (once): the plugin lets the checkpoint's classes load
    utils.import_user_module(argparse.Namespace(user_dir=_value(argv, "--user-dir")))
    return checkpoint_utils.load_checkpoint_to_cpu(last)["optimizer_history"][-1]["num_updates"]


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
    """What fairseq's spawn does with N GPUs, on CPU: one process per rank, forked (from the server,
    they start with fairseq imported)."""
    with tempfile.TemporaryDirectory() as meeting:
        ranks = []
        for r in range(workers):
            rank = [*argv, "--distributed-world-size", str(workers), "--distributed-rank", str(r),
                    "--distributed-init-method", f"file://{meeting}/workers", *GLOO]
            sys.stdout.flush()  # or the rank would print it again
            pid = os.fork()
            if pid == 0:
                os._exit(status_of(run, "fairseq-train", rank, FAIRSEQ["fairseq-train"], "cli_main"))
            ranks.append(pid)
        return max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in ranks)


def status_of(function, *args):
    """function(*args) as a process's main: its exit status, an error printed as Python prints it."""
    status = 1
    try:
        function(*args)
        status = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    with contextlib.suppress(OSError):  # whoever reads its output may be gone
        sys.stdout.flush()
        sys.stderr.flush()
    return status


def fairseq_tool(tool):
    written = sys.argv[1:]
    argv = adjust(tool, written)
    gpus, extra = 1, {}
    if tool == "fairseq-train":
        trained = continued_updates(argv)
        if trained is not None:
            argv += ["--max-update", str(trained + int(overrides(tool)["set"]["--max-update"]))]
            extra["continued"] = trained
        if "RANK" in os.environ:  # a rank started by torchrun
            gpus = int(os.environ.get("RECIPE_TORCHRUN_NPROC", os.environ["WORLD_SIZE"]))
            argv += ["--distributed-init-method", "env://", "--distributed-world-size", os.environ["WORLD_SIZE"],
                     "--distributed-rank", os.environ["RANK"], *GLOO]
        elif int(_value(written, "--distributed-world-size") or 1) > 1 and not _has(written, "--distributed-rank"):
            gpus = int(_value(written, "--distributed-world-size"))
            workers = min(gpus, overrides(tool).get("workers", MAX_WORKERS))
            log_call(tool, written, argv, gpus=gpus, workers=workers, **extra)
            sys.exit(spawn_workers(argv, workers))
    if os.environ.get("RANK", "0") == "0":
        log_call(tool, written, argv, gpus=gpus, **extra)
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


def write(folder):
    """The stand-ins, as executables in `folder` (to put first on PATH): fairseq's CLIs, torchrun, and
    setup.py's console scripts."""
    os.mkdir(folder)
    header = f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {TESTS!r})\nimport recipe_shims\n"
    tools = {tool: f"recipe_shims.main({tool!r})\n" for tool in (*FAIRSEQ, "torchrun")}
    with open(os.path.join(os.path.dirname(TESTS), "setup.py")) as f:
        for name, module, function in re.findall(r"[\"']([\w-]+)\s*=\s*([\w.]+):(\w+)[\"']", f.read()):
            tools[name] = f"recipe_shims.entry_point({name!r}, {module!r}, {function!r})\n"
    for tool, body in tools.items():
        path = os.path.join(folder, tool)
        with open(path, "w") as f:
            f.write(header + body)
        os.chmod(path, 0o755)


def console_script(tool, module, function):
    written = sys.argv[1:]
    argv = adjust(tool, written)
    log_call(tool, written, argv)
    run(tool, argv, module, function)


COMMANDS = {"fairseq": fairseq_tool, "console script": console_script}


def entry_point(tool, module, function):
    """A console script of setup.py, as pip would install it."""
    launch("console script", tool, module, function)


def main(tool):
    if tool == "torchrun":  # it execs torch's launcher, whose ranks are stand-ins again
        torchrun()
    else:
        launch("fairseq", tool)


def launch(kind, *args):
    """COMMANDS[kind](*args), by the server when there is one, else in this process."""
    if "RECIPE_SERVER" not in os.environ:
        return COMMANDS[kind](*args)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        server.connect(os.environ["RECIPE_SERVER"])
        request = {"command": [kind, *args], "argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(server, [json.dumps(request).encode()], [0, 1, 2])
        status = server.recv(16)
    sys.exit(int(status) if status else 1)  # no status: the forked process died


@contextlib.contextmanager
def server(path, env, log):
    """serve(path) in a process of its own while the block runs; its errors go to the file `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(path)], env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(path):
            if proc.poll() is not None:
                raise RuntimeError(f"the command server stopped: {open(log).read()[-3000:]}")
            time.sleep(0.1)
        yield
    finally:
        proc.kill()
        proc.wait()
        os.unlink(path)


def serve(path):
    """Forks a process for each command that connects to the Unix socket `path`."""
    for module in (*FAIRSEQ.values(), "torch._dynamo"):
        importlib.import_module(module)
    signal.signal(signal.SIGCHLD, _reap)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        server.bind(path)
        server.listen(64)
        while True:
            connection, _ = server.accept()
            if os.fork() == 0:
                server.close()
                _run_forwarded(connection)
            connection.close()


def _reap(signum, frame):
    """Waits for the forked processes that ended (so that their CPU time counts as the server's children's)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _run_forwarded(connection):
    """In the forked process: the command, as the stand-in that sent it would run it; never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    for fd, std in zip(fds, (0, 1, 2)):
        os.dup2(fd, std)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    kind, *args = request["command"]
    status = status_of(COMMANDS[kind], *args)
    with contextlib.suppress(OSError):  # the stand-in may be gone
        connection.send(str(status).encode())
    os._exit(status)


if __name__ == "__main__":
    serve(sys.argv[1])
