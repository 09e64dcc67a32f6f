"""Learning curves for the results page (examples/results/README.md): small PNGs and markdown rows.

    python -m fairseq_feedback_cli.curves toy --out results/ checkpoints/toy/*/*/
    python -m fairseq_feedback_cli.curves log --out de_en.png [--metric valid_ppl] checkpoints/debian_de_en/*/train.log
    python -m fairseq_feedback_cli.curves log --out depth.png --metric valid_loss --label "valid bits per byte" \
        --clock cpu runs/cpu_tier/depth/*/train.log
    python -m fairseq_feedback_cli.curves price --out price.png --metric valid_loss --benchmark lm.json \
        runs/cpu_tier/passes/*/train.log

toy: each folder is one model (its name) of one task (its parent folder's
name), holding the test.UPDATES.json files of examples/toy/README.md
(feedback-evaluate-toy --json, one per evaluated checkpoint): for each task, Table 1's
token and episode accuracy against updates, in --out/TASK.png; with --family
NAME, every task in one figure, a panel each, --out/NAME.png.

log: each file is the --log-file of a fairseq-train run with --log-format
json: the validation metric (--metric, as fairseq names it; --label names it
in the figure and the rows) against updates and against hours of training,
one curve per file, named by its folder (a perplexity on a log axis).
Training time is fairseq's wall clock, added up over resumed runs; or, with
--clock cpu, the CPU time per update in the file cpu_seconds beside the log
(a line per process: its user and system seconds, as bash's `time` with
TIMEFORMAT="%U %S" writes them, and the updates it trained;
examples/results/cpu_tier.sh writes them), spread evenly over the updates: a
clock that other work on the machine does not stop.

price: each file is such a log of a feedback_lm run, exact, in passes or
--no-feedback: the metric at its last validation against what a training
step cost, the CPU seconds per update (from cpu_seconds) and the operators
per position that feedback-benchmark --json counted for a model of that kind
(--benchmark, its files: exact feedback's "feedback_lm", a run in passes GxK
"feedback_lm (passes GxK)", --no-feedback fairseq's "transformer_lm"), in
--out (docs/passes.md).

Each prints one markdown row per model: its last point.
"""

import glob
import json
import os
import re

from . import plots
from .command_line import ArgumentParser, command, fail
from .outputs import check_destination
from .toy.scoring import METRICS


def toy_runs(folders):
    """{task folder: {model: [feedback-evaluate-toy's results, by updates]}}."""
    tasks = {}
    for folder in folders:
        folder = os.path.normpath(folder)
        files = glob.glob(os.path.join(folder, "test.*.json"))
        if not files:
            fail(f"{folder} holds no test.UPDATES.json evaluations: is it a model folder of the toy recipe?")
        results = []
        for path in files:
            try:
                with open(path) as f:  # the last line: feedback-evaluate-toy --json's result
                    results.append(json.loads(f.read().strip().splitlines()[-1]))
            except (OSError, ValueError, IndexError) as e:
                fail(f"{path} is not an evaluation's JSON ({e})")
        name, model = os.path.split(folder)
        tasks.setdefault(os.path.basename(name), {})[model] = sorted(results, key=lambda r: r["updates"])
    return tasks


def log_points(path, metric):
    """[(updates, hours, value)] of the validations in a fairseq json log."""
    points, at, offset, last_wall = [], 0.0, 0.0, 0.0
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            stats = json.loads(line)
        except ValueError:
            continue
        if "wall" in stats:
            wall = float(stats["wall"])
            if wall < last_wall:  # a resumed run: its clock starts again
                offset += last_wall
            last_wall = wall
            at = (offset + wall) / 3600
        if metric in stats and "valid_num_updates" in stats:
            points.append((int(stats["valid_num_updates"]), at, float(stats[metric])))
    if not points:
        fail(f"{path} has no {metric}: was it written by fairseq-train --log-format json --log-file?")
    return points


def cpu_hours(log, points):
    """The points of `log` with their hours on the clock of its cpu_seconds, spread evenly over the updates."""
    seconds = cpu_seconds_per_update(log)
    return [(updates, seconds * updates / 3600, value) for updates, _, value in points]


def cpu_seconds_per_update(log, reader="--clock cpu"):
    """The CPU seconds an update took, from the cpu_seconds file beside `log`: a line per process, its 'user
    system' seconds and the updates it trained. A process killed writes no line, and the others still give
    the rate (examples/results/cpu_tier.sh), which `reader` reads."""
    path = os.path.join(os.path.dirname(os.path.abspath(log)), "cpu_seconds")
    try:
        with open(path) as f:
            user, system, updates = (sum(column) for column in zip(*(map(float, line.split()) for line in f)))
        return (user + system) / updates
    except (OSError, ValueError, ZeroDivisionError) as e:
        fail(f"{reader} reads {path}, which lines of 'user system updates' make ({e or 'no updates'})")


def benchmark_model(log):
    """The name feedback-benchmark gives a model of the kind that `log`'s run trained: read from the
    configuration fairseq-train logs first."""
    with open(log, errors="replace") as f:
        config = f.readline()
    if "'no_feedback': True" in config:
        return "transformer_lm"
    passes, group = (re.search(rf"'{name}': (\d+)", config) for name in ("train_passes", "pass_group"))
    if passes is None or group is None:
        fail(f"{log} does not begin with a feedback_lm run's configuration (fairseq-train --log-file, this plugin)")
    if passes[1] == "0":
        return "feedback_lm"
    # the benchmark's passes keep every pass's gradients: a run through the last pass alone has no count
    last = " (gradients through the last pass)" if re.search(r"'pass_gradients': '?last", config) else ""
    return f"feedback_lm (passes {group[1]}x{passes[1]}){last}"


def operators_per_position(paths):
    """{model: ops/step} of the language-model tables in feedback-benchmark --json files."""
    operators = {}
    for path in paths:
        try:
            with open(path) as f:
                table = json.load(f)["tables"]["lm"]
        except (OSError, ValueError, KeyError) as e:
            fail(f"--benchmark {path}: not a feedback-benchmark --json file with the language model's table ({e})")
        operators.update(table["figures"].get("ops/step") or table["figures"].get("kernels/step") or {})
    return operators


def as_hours(seconds):
    return "" if seconds is None else f"{seconds / 3600:.2f}"


@command
def main(argv=None):
    parser = ArgumentParser(prog="python -m fairseq_feedback_cli.curves", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("toy", "log", "price"),
                        help="toy-task evaluations, fairseq-train json logs, or those logs against their cost")
    parser.add_argument("inputs", nargs="+", help="model folders (toy) or log files (log, price)")
    parser.add_argument("--out", required=True, help="toy: the folder for the PNGs; log, price: the PNG")
    parser.add_argument("--benchmark", nargs="+", default=[],
                        help="price: feedback-benchmark --json files, which count each kind of model's operators")
    parser.add_argument("--metric", default="valid_ppl", help="log: the validation metric (default: %(default)s)")
    parser.add_argument("--family", help="toy: one figure, NAME.png, with a panel per task")
    parser.add_argument("--title", default="", help="log: the figure's title")
    parser.add_argument("--label", help="log: the metric's name in the figure and the rows (default: --metric)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="log: hours of fairseq's wall clock, or of the CPU time in cpu_seconds beside each log")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        fail(f"the folder of --out {args.out} does not exist")
    # a log's plot is one file, which must not be a log; toy plots are added to a folder, never replace it
    check_destination(args.out, "--out", reads={"inputs": args.inputs} if args.kind != "toy" else {},
                      folder=args.kind == "toy")
    if args.kind == "toy":
        os.makedirs(args.out, exist_ok=True)
        print("| task | model | updates | token accuracy | episode accuracy | training hours |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        panels = {name: (runs, next(iter(runs.values()))[-1]["task"])
                  for name, runs in sorted(toy_runs(args.inputs).items())}
        figures = {args.family: panels} if args.family else {name: {name: panel} for name, panel in panels.items()}
        for name, family in figures.items():
            plots.save(plots.toy_family(family, title=name), os.path.join(args.out, f"{name}.png"),
                       dpi=80 if len(family) > 2 else 100)  # a tall figure, kept near a single one's bytes
        for name, (runs, task) in panels.items():
            token, episode = METRICS[task]
            for model, results in runs.items():
                last = results[-1]
                print(f"| {name} | {model} | {last['updates']} | {100 * last[token]:.1f} | {100 * last[episode]:.1f} | "
                      f"{as_hours(last.get('train_seconds'))} |")
    elif args.kind == "price":
        operators, points = operators_per_position(args.benchmark), {}
        label = args.label or args.metric
        print(f"| model | updates | {label} | CPU seconds per update | operators per position |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for path in args.inputs:
            updates, _, value = log_points(path, args.metric)[-1]
            name = os.path.basename(os.path.dirname(os.path.abspath(path)))
            points[name] = (cpu_seconds_per_update(path, "price"), operators.get(benchmark_model(path)), value)
            ops = "" if points[name][1] is None else f"{points[name][1]:.0f}"
            print(f"| {name} | {updates} | {value:.4f} | {points[name][0]:.2f} | {ops} |")
        plots.save(plots.price(points, label, args.title), args.out, dpi=90)
    else:
        runs = {}
        for path in args.inputs:
            points = log_points(path, args.metric)
            runs[os.path.basename(os.path.dirname(os.path.abspath(path)))] = \
                cpu_hours(path, points) if args.clock == "cpu" else points
        label = args.label or args.metric
        plots.save(plots.validation_curves(runs, args.metric, args.title, label, args.clock), args.out, dpi=90)
        print(f"| model | updates | {label} | training hours{' (CPU)' if args.clock == 'cpu' else ''} |")
        print("| --- | ---: | ---: | ---: |")
        for name, points in runs.items():
            updates, at, value = points[-1]
            print(f"| {name} | {updates} | {value:.2f} | {at:.2f} |")


if __name__ == "__main__":
    main()
