"""Running fairseq's command-line tools with the plugin, as a user would."""

import os
import re
import socket
import subprocess
import sys

from conftest import PLUGIN, REPO

ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run(tool, *args, stdin=None, check=True, env=None):
    """Runs fairseq_cli.<tool> with the plugin; returns stdout + stderr."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *map(str, args)]
    if tool != "preprocess":
        cmd += ["--user-dir", PLUGIN]
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, env=env or ENV)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_module(module, *args):
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env=ENV, check=True)


def last_number(pattern, text):
    matches = re.findall(pattern, text)
    assert matches, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(matches[-1])


def error_lines(proc):
    """stderr without the warnings fairseq's dependencies print."""
    return [line for line in proc.stderr.splitlines()
            if line.strip() and "Warning" not in line and not line.startswith((" ", "INFO", "WARNING", "\t"))]


def train_on_two_workers(*args):
    """fairseq-train on two CPU workers (gloo, one process per rank, as fairseq
    skips its own launcher under --cpu); returns rank 0's log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "fairseq_cli.train", *map(str, args), "--user-dir", PLUGIN,
             "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-backend", "gloo",
             "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    logs = [w.communicate(timeout=300)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), logs[0][-3000:] + logs[1][-3000:]
    return logs[0]
