"""`make demo`: the Feedback Transformer against a Transformer on a toy task.

    python -m fairseq_feedback_cli.demo --out demo     # about 4 minutes on 2 CPU cores

Table 1's random-walk effect, small enough for a laptop: a walker on a grid
turns left, turns right or steps forward at random, and at every action the
model must name the cell it stands on (data_prep/toy_tasks.py). A Transformer
can update its state only as many times as it has layers; the Feedback
Transformer reads the previous step's top-layer state at every step. Measured
on 2 CPU cores (seeds 1 and 2): after 1,200 updates the feedback model names
99.9-100% of the cells and the transformer of the same size 46%
(examples/toy/README.md).

The demo generates the task (python -m fairseq_feedback_cli.data_prep.toy_tasks),
binarizes it with fairseq-preprocess, trains the feedback model and the
transformer baseline of the same size with fairseq-train (two processes side
by side, one core each), evaluates the checkpoints saved every 100 updates as
feedback-evaluate-toy does (Table 1's accuracy on the test episodes), prints a
table, and writes into --out:

    results.md     the table and each model's best tested checkpoint, the configuration and the commands used
    results.json   the same numbers
    accuracy.png   accuracy against updates, each model's best checkpoint starred
    data/          the task (raw text and binarized)
    feedback/ transformer/   train.log, checkpoint_last.pt and the best tested one, the test predictions

Everything is built in OUT.tmp beside --out, which replaces the old OUT
only when all of it is done: a failed or interrupted run leaves the previous
results as they were. A folder that is not a demo's is never replaced.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import time

import torch

from . import plots
from .command_line import ArgumentParser, check_at_least, command, fail, quiet
from .machine import CORES, SEEDS, check_within, cores
from .outputs import atomic_folder, check_destination
from .toy.predictions import evaluate
from .toy.scoring import METRICS, best

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(REPO, "fairseq_feedback")
MARKER = ".feedback-demo"  # marks a folder this demo wrote (and may replace)
MODELS = {"feedback": [], "transformer": ["--no-feedback"]}

# Chosen by measurement on 2 CPU cores (examples/toy/README.md): the paper's
# random walk shrunk from 8x8 cells and 100 actions per episode to 4x4 and 30,
# a 2-layer model of width 128, and an attention span covering an episode (as
# the paper's 100 covers its episodes); Adam at 1e-3 (the transformer learned
# less at 3e-3), the same options for both models. After the warm-up the rate
# decays to 0 at the last update as the square root of the updates left: held
# at 1e-3, the last checkpoint fell where an oscillation stopped (seed 1 once
# 94.3% of positions at 1,200 updates after 98.4% at 900); along a cosine, the
# rate fell before the feedback model had learned the walk (seeds 1 and 2 ended
# at 83% of the episodes, against 100% and 99.6% with the square root).
CONFIG = {
    "task": "random_walk",
    "task_options": {"grid_size": 4, "episode_length": 30},
    "sizes": {"train": 10000, "valid": 100, "test": 500},
    "seed": 1,
    "model": ["--arch", "feedback_lm_toy", "--decoder-layers", "2", "--decoder-embed-dim", "128",
              "--decoder-ffn-embed-dim", "512", "--decoder-attention-heads", "4", "--memory-span", "32",
              "--dropout", "0", "--attention-dropout", "0", "--activation-dropout", "0"],
    "train": ["--tokens-per-sample", "64", "--batch-size", "32", "--optimizer", "adam", "--lr", "1e-3",
              "--lr-scheduler", "polynomial_decay", "--power", "0.5", "--warmup-updates", "50",
              "--clip-norm", "0.1"],
    "updates": 1200,
    "eval_every": 100,
}

# seconds, for the tests and a quick look: a few updates on a few episodes
TINY = dict(
    CONFIG,
    sizes={"train": 200, "valid": 10, "test": 20},
    model=["--arch", "feedback_lm_toy", "--decoder-layers", "1", "--decoder-embed-dim", "16",
           "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--memory-span", "32", "--dropout", "0",
           "--attention-dropout", "0", "--activation-dropout", "0"],
    train=["--tokens-per-sample", "64", "--batch-size", "4", "--optimizer", "adam", "--lr", "1e-3",
           "--lr-scheduler", "polynomial_decay", "--power", "0.5", "--clip-norm", "0.1"],
    updates=4,
    eval_every=2,
)


def log(message):
    print(message, flush=True)


def python_module(module, *args):
    return [sys.executable, "-m", module, *map(str, args)]


def child_env(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    return env


def run_checked(cmd, log_path, env):
    with open(log_path, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        fail(f"{shlex.join(cmd)} failed (exit {proc.returncode}); its log:\n{tail(log_path)}")


def tail(path, lines=15):
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# --- the steps ----------------------------------------------------------------------------


def make_data(folder, config, env):
    """Generates the task into folder/raw and binarizes it into folder/bin
    (labels in folder/bin/labels); returns (raw task folder, data directory)."""
    os.makedirs(folder)
    options = {**config["sizes"], **config["task_options"]}
    run_checked(python_module("fairseq_feedback_cli.data_prep.toy_tasks", config["task"], "--out",
                              os.path.join(folder, "raw"), "--seed", config["seed"],
                              *[a for name, value in options.items() for a in (f"--{name.replace('_', '-')}", value)]),
                os.path.join(folder, "generate.log"), env)
    raw = os.path.join(folder, "raw", config["task"])
    data = os.path.join(folder, "bin")
    for kind, dest in (("input", data), ("labels", os.path.join(data, "labels"))):
        args = [a for split in config["sizes"] for a in (f"--{split}pref", os.path.join(raw, f"{split}.{kind}"))]
        run_checked(python_module("fairseq_cli.preprocess", "--only-source", *args, "--destdir", dest,
                                  "--workers", "1"), os.path.join(folder, f"preprocess.{kind}.log"), env)
    return raw, data


def train_command(data, save_dir, config, flags):
    every = config["eval_every"]
    return python_module(
        "fairseq_cli.train", data, "--user-dir", PLUGIN, "--task", "feedback_language_modeling",
        "--labels", "labels", *config["model"], *flags, *config["train"],
        # the decay ends at the last update; polynomial_decay's default for it (--max-update) fails to compose
        # from the command line
        "--max-update", config["updates"], "--total-num-update", config["updates"],
        "--save-interval-updates", every, "--keep-interval-updates", -1,
        "--save-dir", save_dir, "--disable-validation", "--seed", config["seed"],
        "--log-format", "simple", "--log-interval", max(1, min(every, 50)), "--num-workers", 0)


def last_update(log_path):
    try:
        with open(log_path, errors="replace") as f:
            found = re.findall(r"num_updates=(\d+)", f.read())
    except FileNotFoundError:
        return 0
    return int(found[-1]) if found else 0


def train_all(folder, data, config, threads, on_done=None, poll=15.0):
    """Trains every model side by side, calling on_done(name, save_dir) as
    each one finishes (while the others go on); returns {name: (save_dir,
    seconds, command)}."""
    procs, runs, logs = {}, {}, {}
    env = child_env(threads)
    start = time.time()
    try:
        for name, flags in MODELS.items():
            save_dir = os.path.join(folder, name)
            os.makedirs(save_dir)
            logs[name] = os.path.join(save_dir, "train.log")
            cmd = train_command(data, save_dir, config, flags)
            runs[name] = (save_dir, cmd)
            with open(logs[name], "w") as out:
                procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        seconds = {}
        while len(seconds) < len(procs):
            deadline = time.time() + poll
            while time.time() < deadline and all(p.poll() is None for n, p in procs.items() if n not in seconds):
                time.sleep(0.2)
            progress = ", ".join(f"{name} {last_update(logs[name])}/{config['updates']}" for name in procs)
            log(f"  {time.time() - start:5.0f}s  updates: {progress}")
            for name, proc in procs.items():
                if name not in seconds and proc.poll() is not None:
                    if proc.returncode:
                        fail(f"training the {name} model failed (exit {proc.returncode}): "
                                        f"{shlex.join(runs[name][1])}\n{tail(logs[name])}")
                    seconds[name] = time.time() - start
                    if on_done is not None:
                        on_done(name, runs[name][0])
        return {name: (runs[name][0], seconds[name], runs[name][1]) for name in procs}
    finally:
        for proc in procs.values():  # only on failure or interruption are they still running
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()


def checkpoint_updates(path):
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(path)
    return (state.get("optimizer_history") or [{}])[-1].get("num_updates")


def checkpoints(save_dir, every):
    """{updates: path} of the checkpoints at multiples of `every` updates and of the last one."""
    found = {}
    last = os.path.join(save_dir, "checkpoint_last.pt")
    names = sorted(os.listdir(save_dir))
    for name in names:
        match = re.fullmatch(r"checkpoint_\d+_(\d+)\.pt", name)
        if match:
            found[int(match.group(1))] = os.path.join(save_dir, name)
    others = [os.path.join(save_dir, n) for n in names if re.fullmatch(r"checkpoint\d+\.pt", n)]
    if os.path.exists(last):
        others.append(last)
    final = None
    for path in others:  # epoch ends (no checkpoint_E_U is written there) and the last one
        updates = checkpoint_updates(path)
        if updates is not None and path == last:
            final = updates
        if updates is not None and updates not in found and (updates % every == 0 or path == last):
            found[updates] = path
    return dict(sorted(found.items())), final


def evaluate_model(name, save_dir, raw, data, config):
    """[result of toy.predictions.evaluate for each checkpoint, by updates];
    then removes the checkpoints but the last and the best (the predictions stay)."""
    results = []
    predictions = os.path.join(save_dir, "predictions")
    os.makedirs(predictions)
    found, _ = checkpoints(save_dir, config["eval_every"])
    if not found:
        fail(f"the {name} run saved no checkpoint in {save_dir}")
    for updates, path in found.items():
        result = evaluate(config["task"], data, path, split="test", raw=os.path.join(raw, "test.labels"),
                          output=os.path.join(predictions, f"test.{updates}.txt"))
        result["checkpoint"] = os.path.basename(path)
        result["predictions"] = os.path.relpath(result["predictions"], os.path.dirname(save_dir))
        results.append(result)
        log(f"  {name:12s} {updates:6d} updates: " + "  ".join(
            f"{metric} {100 * result[metric]:.1f}" for metric in METRICS[config["task"]]))
    keep = {"checkpoint_last.pt", best(config["task"], results)["checkpoint"]}
    for file in os.listdir(save_dir):
        if file.endswith(".pt") and file not in keep:
            os.remove(os.path.join(save_dir, file))
    return results


# --- the report -------------------------------------------------------------------------------


def table(results, task):
    """A markdown table: one row per update count, each model's metrics in percent."""
    token_metric, line_metric = METRICS[task]
    names = list(results)
    by_updates = {}
    for name in names:
        for r in results[name]:
            by_updates.setdefault(r["updates"], {})[name] = r
    header = ["updates"] + [f"{name} {metric}" for name in names for metric in (token_metric, line_metric)]
    rows = [header, ["---:"] * len(header)]
    for updates in sorted(by_updates):
        row = [str(updates)]
        for name in names:
            r = by_updates[updates].get(name)
            row += [f"{100 * r[m]:.1f}" if r else "" for m in (token_metric, line_metric)]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("| " + " | ".join(cell.rjust(w) for cell, w in zip(row, widths)) + " |" for row in rows)


def best_line(results, task):
    """The line under the table naming each model's best tested checkpoint (toy.scoring.best) and its
    file, which the demo keeps: the last one need not be the best."""
    token_metric, line_metric = METRICS[task]
    picks = {name: best(task, rs) for name, rs in results.items()}
    return f"Best tested checkpoint (by {token_metric}, then {line_metric}): " + "; ".join(
        f"{name} at {r['updates']} updates ({100 * r[token_metric]:.1f} / {100 * r[line_metric]:.1f}, "
        f"`{name}/{r['checkpoint']}`)" for name, r in picks.items()) + "."


def summary(config):
    """The models' sizes and training in a few words, from their options."""
    flags = config["model"] + config["train"]

    def value(flag):
        return flags[flags.index(flag) + 1] if flag in flags else "?"

    return (f"{value('--decoder-layers')} layers, d {value('--decoder-embed-dim')}, "
            f"FFN {value('--decoder-ffn-embed-dim')}, {value('--decoder-attention-heads')} heads, "
            f"span {value('--memory-span')}; {value('--batch-size')} streams x {value('--tokens-per-sample')} "
            f"tokens, Adam lr {value('--lr')}, {value('--lr-scheduler')} (power {value('--power')})")


def describe(config):
    options = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in config["task_options"].items())
    sizes = ", ".join(f"{v} {k}" for k, v in config["sizes"].items())
    return f"{config['task']} ({options}; {sizes} episodes)"


def report(folder, config, runs, results, seconds):
    title = describe(config)
    text = table(results, config["task"]) + "\n\n" + best_line(results, config["task"])
    checkpoint = best(config["task"], results["feedback"])["checkpoint"]
    model = " ".join(config["model"])
    lines = [
        "# Feedback Transformer demo", "",
        f"Task: {title}. Test accuracy of the label at every position, as Table 1 of the paper "
        f"defines it ({' / '.join(METRICS[config['task']])}: token / whole-episode accuracy).", "",
        text, "",
        f"Both models ({summary(config)}): `{model}`, trained for {config['updates']} updates with "
        f"`{' '.join(config['train'])}`; the transformer adds `--no-feedback`.", "",
        "Training time (two runs side by side): " + ", ".join(f"{name} {runs[name][1]:.0f}s" for name in runs)
        + f"; the whole demo {seconds:.0f}s.", "",
        "Commands:", "",
        *[f"    {shlex.join(runs[name][2])}" for name in runs], "",
        "Evaluate a checkpoint again, from this folder:", "",
        f"    python -m fairseq_feedback_cli.toy.evaluate --task {config['task']} --data data/bin "
        f"--path feedback/{checkpoint} --raw data/raw/{config['task']}/test.labels", "",
    ]
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(folder, "results.json"), "w") as f:
        json.dump({"config": config, "results": results,
                   "best": {name: best(config["task"], rs)["updates"] for name, rs in results.items()},
                   "seconds": seconds,
                   "train_seconds": {name: runs[name][1] for name in runs}}, f, indent=1)
    plots.save(plots.toy_accuracy(results, config["task"], title=f"{title}\n{summary(config)}"),
               os.path.join(folder, "accuracy.png"))
    return text


# --- the output folder ---------------------------------------------------------------------------


def check_replaceable(out):
    if os.path.exists(out) and not (os.path.isdir(out) and (os.path.exists(os.path.join(out, MARKER))
                                                             or not os.listdir(out))):
        fail(f"{out} exists and is not a folder this demo wrote: pass another --out")


def run(out, config=CONFIG, threads=None):
    """The whole demo; returns the markdown table. `out` appears complete or is left as it was."""
    start = time.time()
    out = os.path.abspath(out)
    threads = threads or max(1, (os.cpu_count() or 2) // len(MODELS))
    with atomic_folder(out, check=check_replaceable) as building:
        tmp = str(building)
        open(os.path.join(tmp, MARKER), "w").close()
        log(f"[1/3] generating {describe(config)} and binarizing it")
        raw, data = make_data(os.path.join(tmp, "data"), config, child_env(threads))
        log(f"[2/3] training the feedback model and the transformer side by side ({config['updates']} updates, "
            f"{threads} thread{'s' if threads > 1 else ''} each); each one's checkpoints (every "
            f"{config['eval_every']} updates) are evaluated on the test episodes when it is done")
        results = {}

        def evaluate_finished(name, save_dir):
            torch.set_num_threads(threads)  # the other model is still training
            results[name] = evaluate_model(name, save_dir, raw, data, config)

        runs = train_all(tmp, data, config, threads, on_done=evaluate_finished)
        results = {name: results[name] for name in MODELS}
        seconds = time.time() - start
        # paths in the report relative to the final folder
        rel_runs = {name: (save_dir, secs, [a.replace(tmp, out) for a in map(str, cmd)])
                    for name, (save_dir, secs, cmd) in runs.items()}
        text = report(tmp, config, rel_runs, results, seconds)
    log(f"[3/3] done in {time.time() - start:.0f}s: {out}/results.md, {out}/accuracy.png\n")
    log(describe(config) + ", test accuracy (%)\n")
    log(text)
    return text


@command
def main(argv=None):
    parser = ArgumentParser(prog="python -m fairseq_feedback_cli.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo", help="the results folder (a previous demo's is replaced)")
    parser.add_argument("--updates", type=int, help=f"training updates (default {CONFIG['updates']})")
    parser.add_argument("--eval-every", type=int, help=f"updates between evaluations (default {CONFIG['eval_every']})")
    parser.add_argument("--seed", type=int, help=f"seed of the data and of training (default {CONFIG['seed']})")
    parser.add_argument("--threads", type=int, help="threads per training run (default: half the cores)")
    parser.add_argument("--tiny", action="store_true", help="a few updates of a tiny model: checks that it runs")
    args = parser.parse_args(argv)
    # before anything is written: the counts, the seed (numpy's range) and the threads (this machine's cores)
    check_at_least(args, updates=1, eval_every=1)
    check_within(args, threads=(1, cores(), CORES), seed=SEEDS)
    config = dict(TINY if args.tiny else CONFIG)
    for key in ("updates", "eval_every", "seed"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    check_destination(args.out, "--out", folder=True)
    quiet()
    try:
        run(args.out, config, args.threads)
    except KeyboardInterrupt:
        fail("interrupted; the previous results (if any) are unchanged")


if __name__ == "__main__":
    main()
