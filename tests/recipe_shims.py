"""Stand-ins for the commands the recipes in examples/*/README.md call, for tests/test_recipes.py.

tests/test_recipes.py runs the README's shell blocks as they are, with a
folder of these stand-ins first on PATH. Each runs the real tool (fairseq's
CLI function, or this package's console-script function named in setup.py)
in a new process, on the command line it was given, after three CPU-only
changes taken from $RECIPE_OVERRIDES, a JSON object {tool: {"drop": [...],
"set": {option: value}, "add": [...]}}:

- "drop": flags removed (--fp16: fairseq trains in half precision on CUDA only);
- "set": options the command has are given another value, appended so that
  argparse's last-one-wins applies (a few updates instead of 50,000, tiny
  batches and blocks);
- "add": options appended always (--cpu, the tiny model's sizes).

Multi-GPU launches become two CPU workers talking over gloo, as fairseq
itself cannot on CPU: `fairseq-train --distributed-world-size N` (fairseq's
own spawn, which needs N GPUs) starts two processes with explicit ranks, and
under torchrun (the `torchrun` stand-in caps --nproc_per_node at 2) each rank
gets torchrun's RANK and WORLD_SIZE as explicit options, since fairseq divides
by the number of GPUs to find its device. Every call is appended to
$RECIPE_CALLS (JSON lines: the tool, the command line as written and as run,
and how many GPUs it asked for) for the test to check.

Importing torch and fairseq costs each command about 3 s of CPU, most of the
recipes' time. With $RECIPE_ZYGOTE set (a Unix socket), the stand-ins ask a
server that imported them once (`serve`) to fork a process for the command,
handing it their standard input, output and error, their folder and
environment: the same function runs on the same command line, in a fresh
process, without the imports. Without it they run the tool themselves.
"""

import importlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading

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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(argv, workers):
    """What fairseq's spawn does with N GPUs, on CPU: one process per rank."""
    port = free_port()
    results = [1] * workers

    def rank(r):
        results[r] = run("fairseq-train", [*argv, "--distributed-world-size", str(workers), "--distributed-rank",
                                           str(r), "--distributed-init-method", f"tcp://127.0.0.1:{port}", *GLOO])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(results)


def run(tool, argv, target=None, fds=(0, 1, 2), env=None):
    """Runs the tool on argv: forked by the server when there is one, else in a
    child process. The forked process gets `fds` as its standard input, output
    and error, and `env` (default: this process's) as its environment."""
    target = target or ("fairseq", FAIRSEQ[tool], "cli_main")
    env = dict(os.environ if env is None else env)
    request = {"tool": tool, "argv": argv, "target": target, "cwd": os.getcwd(), "env": env}
    path = env.get("RECIPE_ZYGOTE")
    if not path:
        import subprocess

        code = f"import sys, importlib; sys.argv = {[tool, *argv]!r}; " \
               f"sys.exit(getattr(importlib.import_module({target[1]!r}), {target[2]!r})())"
        return subprocess.call([sys.executable, "-c", code])
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        payload = json.dumps(request).encode()
        socket.send_fds(s, [struct.pack("!Q", len(payload)) + payload], list(fds))
        reply = b""
        while len(reply) < 4:
            chunk = s.recv(4 - len(reply))
            if not chunk:
                return 1  # the process died without a word
            reply += chunk
    return struct.unpack("!i", reply)[0]


def start_server(log_path, preload=()):
    """Starts `serve` in a new process: (the process, the path of its socket).
    `preload` names further modules for it to import once, such as the plugin
    (only for commands whose --user-dir is the plugin's own path: fairseq
    refuses another path to a module already imported)."""
    import subprocess
    import tempfile
    import time

    tests = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(tempfile.mkdtemp(prefix="recipes-"), "zygote")  # short: a socket path has a limit
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); "
                                 f"import recipe_shims; recipe_shims.serve({path!r}, {list(preload)!r})"],
                                env=dict(os.environ, PYTHONPATH=os.path.dirname(tests), OMP_NUM_THREADS="1",
                                         PYTHONWARNINGS="ignore"),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log_path) as log:
                raise RuntimeError(f"the fork server did not start:\n{log.read()[-3000:]}")
        time.sleep(0.1)
    return proc, path


def stop_server(proc, path):
    proc.kill()
    proc.wait()
    os.unlink(path)
    os.rmdir(os.path.dirname(path))


def serve(path, preload=()):
    """Forks a process per request, after importing torch, fairseq and `preload` once."""
    import torch  # noqa: F401
    import fairseq  # noqa: F401

    for module in preload:
        importlib.import_module(module)

    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(0.5)
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the test run that started it
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        conn.settimeout(None)
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        size = struct.unpack("!Q", data[:8])[0]
        while len(data) < 8 + size:
            data += conn.recv(1 << 20)
        request = json.loads(data[8:8 + size])
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _child(conn, fds, request)
        conn.close()
        for fd in fds:
            os.close(fd)


def _child(conn, fds, request):
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["tool"], *request["argv"]]
    if request["tool"] == "fairseq-train":  # fairseq-train sets up logging before importing fairseq: let it
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)

    def watch():  # the stand-in went away (killed, or its caller was): so does this process
        if not conn.recv(1):
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    code = 0
    try:
        _, module, function = request["target"]
        tool = importlib.import_module(module)
        if "fairseq_feedback" in sys.modules:  # preloaded: imported before this process became the tool
            sys.modules["fairseq_feedback"].patches.apply()
        result = getattr(tool, function)()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        try:
            conn.sendall(struct.pack("!i", code))
        finally:
            os._exit(code)


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
    sys.exit(run(tool, argv))


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
    sys.exit(run(tool, argv, ("entry point", module, function)))


def main(tool):
    if tool == "torchrun":
        torchrun()
    else:
        fairseq_tool(tool)
