"""feedback-gpu-check on the CPU: the whole sequence a GPU runs, at tiny sizes, with the graphs
through the stand-in for capture (every line but the raw CUDA calls); its report, written whole;
and its exit status, which names a failing step and says when steps were skipped for time.

The whole run is made once, its fairseq and benchmark commands forked by the recipes' command
server (tests/recipe_shims.py: torch and fairseq imported once, most of what a command costs at
these sizes), its GPU tests a folder of three (the checkout's own take seconds to collect, and
all skip on the CPU), in `make test-slow`. The other tests run steps that stand in for the real
ones, a real step on a command's recorded output, or step 3d with its benchmark in this process;
their commands, where they run any, are not Python."""

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import sys
from unittest import mock

import pytest
import torch

import recipe_shims
from helpers import ENV, run_module

from fairseq_feedback_cli import benchmark
from fairseq_feedback_cli.gpu_check import cli
from fairseq_feedback_cli.gpu_check.check import NOT_MEASURED, REPO, Check, Command, Outcome, Step, StepFailed
from fairseq_feedback_cli.gpu_check.gpu_tests import checkout_tests, gpu_tests
from fairseq_feedback_cli.gpu_check.machine import nvidia_smi_gpus
from fairseq_feedback_cli.gpu_check.sizes import LOSS_TOLERANCE
from fairseq_feedback_cli.gpu_check.speed import rows_sweep
from fairseq_feedback_cli.gpu_check.training import compare_training, no_shape_repeated, training_comparison

# what the tests replace, where the check reads it
LAUNCHER = "fairseq_feedback_cli.gpu_check.check.launcher"
CHECKOUT_TESTS = "fairseq_feedback_cli.gpu_check.gpu_tests.checkout_tests"

PROBE_TESTS = '''
import pytest


@pytest.mark.gpu
def test_on_the_gpu():
    pass


@pytest.mark.gpu
@pytest.mark.skip(reason="needs a CUDA GPU")
def test_skipped_on_this_machine():
    pass


def test_not_a_gpu_test():
    raise AssertionError("-m gpu deselects it")
'''


def via_the_server(shims):
    """The check's launcher with fairseq's tools and feedback-benchmark as the recipes' stand-ins in `shims`."""
    names = {module: name for name, module in recipe_shims.FAIRSEQ.items()}
    names["fairseq_feedback_cli.benchmark"] = "feedback-benchmark"
    return lambda module: [os.path.join(shims, names[module])] if module in names else [sys.executable, "-m", module]


def probe_tests(root):
    tests = root / "tests"
    tests.mkdir()
    (tests / "test_probe.py").write_text(PROBE_TESTS)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    return str(tests)


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """(the run's output, its report.json, report.md, the folder) of the whole check on the CPU."""
    root = tmp_path_factory.mktemp("gpu-check")
    recipe_shims.write(str(root / "bin"))
    server = str(root / "server.sock")
    with recipe_shims.server(server, ENV, root / "server.log"), \
            mock.patch.dict(os.environ, RECIPE_SERVER=server), \
            mock.patch(LAUNCHER, via_the_server(str(root / "bin"))), \
            mock.patch(CHECKOUT_TESTS, lambda: probe_tests(root)):
        proc = run_module("fairseq_feedback_cli.gpu_check.cli", "--device", "cpu", "--cuda-graphs", "emulate",
                          "--updates", 4, "--out", root / "out", check=False)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    out = root / "out"
    return proc.stdout, json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out


@pytest.mark.slow
def test_the_whole_sequence_runs_on_the_cpu_in_order_with_a_line_per_step(checked):
    stdout, report, _, out = checked
    keys = [step.key for step in cli.STEPS]
    assert [record["step"] for record in report["steps"]] == keys == ["1", "2", "3a", "3b", "3c", "3d", "3e", "4"]
    assert all(record["status"] == "passed" for record in report["steps"]), report["steps"]
    finished = re.findall(r"^\[(\w+)\] passed in \d+ s: ", stdout, re.M)
    assert finished == keys
    assert stdout.rstrip().splitlines()[-1].startswith("feedback-gpu-check: passed in ")
    assert report["status"] == "passed" and report["exit status"] == 0
    assert not os.path.exists(f"{out}.tmp") and os.path.exists(out / cli.MARKER)
    for record in report["steps"]:  # each command's output kept, each command shown at the final folder's paths
        assert record["logs"] and all((out / log).is_file() for log in record["logs"])
        assert not any(".tmp" in command for command in record["commands"])


@pytest.mark.slow
def test_the_gpu_tests_run_in_one_process_and_their_counts_are_reported(checked):
    _, report, _, _ = checked
    tests = report["steps"][0]
    assert tests["commands"] == ["python -m pytest -q -m gpu -rfEs -p no:cacheprovider tests"]
    assert tests["figures"] == {"pytest exit status": 0, "passed": 1, "skipped": 1, "deselected": 1, "failed": []}


@pytest.mark.slow
def test_training_with_graphs_gives_the_losses_of_training_without(checked):
    _, report, _, _ = checked
    record = report["steps"][1]
    for precision in ("fp32", "fp16"):
        figures = record["figures"][precision]
        assert figures["graphs captured"] > 0 and figures["loss scalers parted at"] is None
        assert figures["largest loss difference (bits/token)"] <= LOSS_TOLERANCE[precision]
        graphs, eager = figures["losses (bits/token)"].values()
        assert list(graphs) == list(eager) == ["update 1", "update 2", "update 3", "update 4", "validation 1"]
        assert figures["points compared"] == 5
    assert sum("--fp16" in command for command in record["commands"]) == 2


@pytest.mark.slow
def test_the_benchmark_compares_graphs_eager_and_fairseq_and_says_what_the_cpu_cannot_measure(checked):
    _, report, markdown, _ = checked
    for record, fairseq, feedback in ((report["steps"][2], "transformer", "feedback_transformer"),
                                      (report["steps"][3], "transformer_lm", "feedback_lm")):
        table = record["figures"]
        assert table["models"] == [fairseq, feedback, f"{feedback} (eager)"]
        for rate in ("train tok/s", "first 4 tok/s"):
            assert all(value > 0 for value in table["figures"][rate].values())
        assert table["figures"]["capture s/shape"][feedback] > 0
        assert table[NOT_MEASURED] == ["peak train MB", "peak beam MB" if fairseq == "transformer"
                                       else "peak sample MB"]
    assert f"| {NOT_MEASURED} |" in markdown  # peak memory, in the benchmark's tables
    eval_lm = report["steps"][4]["figures"]
    assert set(eval_lm["tokens/s"]) == {"feedback_lm", "feedback_lm (eager)", "transformer_lm"}
    assert eval_lm["graphs captured"] > 0


@pytest.mark.slow
def test_the_rows_sweep_gives_every_model_at_each_batch_each_at_its_best_and_the_profile(checked):
    """Steps 3d and 3e, feedback-benchmark --rows: every model at every
    batch (3e's feedback_lm also trained in passes, --train-passes 4
    --pass-group 16), the best-batch ratios, and the exact feedback model's
    step profiled at the smallest and the largest, operator by operator on
    the CPU, beside the sweep."""
    _, report, markdown, out = checked
    for key, only, models, batches in (
            ("3d", "translation", ["transformer", "feedback_transformer"], [2, 8]),
            ("3e", "lm", ["transformer_lm", "feedback_lm", "feedback_lm (passes 16x4)"], [8, 32, 128])):
        fairseq, feedback = models[:2]
        (record,) = [r for r in report["steps"] if r["step"] == key]
        sweep = record["figures"]
        assert [batch["rows"] for batch in sweep["batches"]] == batches and sweep["models"] == models
        assert ("--train-passes 4 --pass-group 16" in record["commands"][0]) == (only == "lm")
        for batch in sweep["batches"]:
            assert all(batch["figures"][model]["train tok/s"] > 0 for model in models)
            assert batch["figures"][feedback]["graphs MB"] > 0 and batch["figures"][fairseq]["peak MB"] is None
        best = sweep["best"]
        for model in models[1:]:
            assert best[model]["feedback / fairseq"] == pytest.approx(
                best[model]["train tok/s"] / best[fairseq]["train tok/s"])
        assert best["feedback / fairseq"] == best[feedback]["feedback / fairseq"]
        assert set(sweep["profiles"]) == {str(batches[0]), str(batches[-1])}
        for table in sweep["profiles"].values():
            assert table["kind"] == "operator" and table["rows"] and 0 < table["share"] <= 1
            assert table["counted per step"] == pytest.approx(table["per step"], rel=0.02)
        printed = (out / "logs" / f"rows-{only}.log").read_text()
        for rows in batches:
            for model in models:
                assert re.search(rf"^\s+{rows}\s+{re.escape(model)}\s+[\d,.]+", printed, re.M), (rows, model)
        assert re.search(r"^each at its fastest batch .*; feedback / fairseq \d+\.\d\d(, .+ / fairseq \d+\.\d\d)*$",
                         printed, re.M)
        section = markdown.split(f"### {key}. ")[1].split("\n### ")[0]
        assert "| operator | per target step | us per target step | share | shapes |" in section
        assert all(f"| {batches[-1]} | {model} | " in section for model in models) and NOT_MEASURED in section


def sweep_figures(rate, ratio, kernels, read):
    """A model's figures at a batch, as feedback-benchmark --rows --json writes them on a GPU."""
    return {"train tok/s": rate, "feedback / fairseq": ratio, "ms/step": 8192 * 1000 / rate, "peak MB": 2048.0,
            "graphs MB": None, "graphs gave up": None, "kernels/step": kernels, "GPU busy": 0.5,
            "MB read/step": read, "ms at the bandwidth": read * 2**20 / 4.8e9}


# feedback-benchmark --rows 32,128,512 --train-passes 4 --pass-group 16 --json, on a GPU: three models,
# the largest batch out of memory (the figures made up, round to read)
SWEEP_IN_PASSES = {
    "rows": [32, 128, 512], "unit": "streams", "models": ["transformer_lm", "feedback_lm", "feedback_lm (passes 16x4)"],
    "batches": [
        {"rows": 32, "feedback / fairseq": 0.41, "figures": {
            "transformer_lm": sweep_figures(100000.0, None, 14.0, 60.0),
            "feedback_lm": sweep_figures(41000.0, 0.41, 140.0, 1900.0),
            "feedback_lm (passes 16x4)": sweep_figures(65000.0, 0.65, 40.0, 500.0)}},
        {"rows": 128, "feedback / fairseq": 0.6, "figures": {
            "transformer_lm": sweep_figures(200000.0, None, 14.0, 60.0),
            "feedback_lm": sweep_figures(120000.0, 0.6, 140.0, 9500.0),
            "feedback_lm (passes 16x4)": sweep_figures(160000.0, 0.8, 40.0, 2500.0)}},
        {"rows": 512, "out of memory": "CUDA out of memory. Tried to allocate 2.00 GiB"}],
    "best": {"transformer_lm": {"rows": 128, "train tok/s": 200000.0},
             "feedback_lm": {"rows": 128, "train tok/s": 120000.0, "feedback / fairseq": 0.6},
             "feedback_lm (passes 16x4)": {"rows": 128, "train tok/s": 160000.0, "feedback / fairseq": 0.8},
             "feedback / fairseq": 0.6},
    "memory budget MB": 139.0 * 1024, "bandwidth GB/s": 4800.0, "profiles": {}}


def test_step_3e_runs_the_model_in_passes_beside_exact_feedback_and_reports_every_model(tmp_path):
    """Step 3e's command asks for the model in passes (sizes.py), and its
    section renders a sweep of three models: a row of each at each batch,
    each feedback model's ratio to fairseq's beside its rate and at its
    fastest batch, in the summary and under the table."""
    args = argparse.Namespace(size="full", minutes=13.0, tolerance=None, device="cuda", cuda_graphs="auto")
    check = Check(args, str(tmp_path), str(tmp_path), {"device": "NVIDIA H200"}, ["feedback-gpu-check"])
    commands = []

    def benchmark_writes_its_json(command):
        commands.append(command.args)
        with open(command.args[command.args.index("--json") + 1], "w") as f:
            json.dump({"rows": {"lm": SWEEP_IN_PASSES}}, f)

    with mock.patch.object(check, "run", benchmark_writes_its_json):
        outcome = rows_sweep(check, "lm")
    (args,) = commands
    assert " --rows 32,128,512 --train-passes 4 --pass-group 16 --json " in f" {' '.join(args)} "
    assert outcome.summary == (
        "each at its fastest batch, feedback / fairseq 0.60, feedback_lm (passes 16x4) / fairseq 0.80 "
        "(transformer_lm at 128 rows (200,000 tok/s), feedback_lm at 128 rows (120,000 tok/s), "
        "feedback_lm (passes 16x4) at 128 rows (160,000 tok/s)); at 32 rows 0.41")
    markdown = "\n".join(outcome.markdown)
    assert "`feedback-benchmark --preset iwslt --rows 32,128,512 --train-passes 4 --pass-group 16`" in markdown
    for line in ("| 32 | transformer_lm | 100,000 | - | ", "| 32 | feedback_lm | 41,000 | 0.41 | ",
                 "| 32 | feedback_lm (passes 16x4) | 65,000 | 0.65 | ",
                 "| 128 | feedback_lm (passes 16x4) | 160,000 | 0.80 | ",
                 "| 512 | out of memory: CUDA out of memory. Tried to allocate 2.00 GiB |"):
        assert line in markdown, line
    assert outcome.markdown[-1] == (
        "Each at its fastest batch within 139.0 GB: transformer_lm at 128 rows (200,000 tok/s), feedback_lm at 128 "
        "rows (120,000 tok/s), feedback_lm (passes 16x4) at 128 rows (160,000 tok/s); feedback / fairseq 0.60, "
        "feedback_lm (passes 16x4) / fairseq 0.80.")


def test_step_3d_on_the_cpu_gives_each_model_at_each_batch_and_the_profile_at_the_smallest_and_the_largest(tmp_path):
    """Step 3d as `--device cpu --cuda-graphs emulate` runs it (--size tiny: feedback-benchmark --rows 2,8
    in fp16), the benchmark run in this process: each model at each batch, the ratio at the fastest, and
    exact feedback's training step profiled operator by operator at 2 and at 8 rows, in the report."""
    args = argparse.Namespace(size="tiny", minutes=13.0, tolerance=None, device="cpu", cuda_graphs="emulate")
    check = Check(args, str(tmp_path), str(tmp_path), {"device": "CPU: this one"}, ["feedback-gpu-check"])

    def benchmark_in_this_process(command):
        assert command.module == "fairseq_feedback_cli.benchmark"
        with open(check.path("logs", command.log), "w") as log, contextlib.redirect_stdout(log):
            benchmark.main([str(a) for a in command.args])

    with mock.patch.object(check, "run", benchmark_in_this_process):
        outcome = rows_sweep(check, "translation")
    sweep, markdown = outcome.figures, "\n".join(outcome.markdown)
    assert [batch["rows"] for batch in sweep["batches"]] == [2, 8]
    assert sweep["models"] == ["transformer", "feedback_transformer"]
    for batch in sweep["batches"]:
        figures = batch["figures"]
        assert figures["transformer"]["train tok/s"] > 0 and figures["feedback_transformer"]["graphs MB"] > 0
        assert figures["transformer"]["peak MB"] is None  # torch.cuda's, on a GPU
        for model in sweep["models"]:
            assert f"| {batch['rows']} | {model} | " in markdown
    best = sweep["best"]
    assert best["feedback / fairseq"] == pytest.approx(
        best["feedback_transformer"]["train tok/s"] / best["transformer"]["train tok/s"])
    assert outcome.summary.startswith(f"each at its fastest batch, feedback / fairseq {best['feedback / fairseq']:.2f}")
    assert set(sweep["profiles"]) == {"2", "8"}
    for rows, table in sweep["profiles"].items():
        assert table["kind"] == "operator" and table["rows"] and 0 < table["share"] <= 1
        assert table["counted per step"] == pytest.approx(table["per step"], rel=0.02)
        assert f"Where a training step of feedback_transformer at {rows} rows goes, operator by operator: " in markdown
    assert markdown.count("| operator | per target step | us per target step | share | shapes |") == 2
    assert f"| {NOT_MEASURED} |" in markdown  # peak MB


@pytest.mark.slow
def test_step_3e_runs_the_rows_sweep_of_docs_performance_md(checked):
    """The page's command, at the check's sizes and with its options (tiny,
    fp16, the graphs through the stand-in; one thread on the CPU); the
    columns of the table the page shows, among those it printed."""
    _, report, _, out = checked
    page = open(os.path.join(REPO, "docs/performance.md")).read()
    (block,) = re.findall(r"<!-- run by tests/test_gpu_check.py -->\n```bash\n(.*?)```", page, flags=re.S)
    (record,) = [r for r in report["steps"] if r["step"] == "3e"]

    def options(words):
        return dict(zip(words[1::2], words[2::2]))

    shown, ran = block.split(), record["commands"][0].split()
    assert ran[0] == shown[0] == "feedback-benchmark"
    assert {k: v for k, v in options(shown).items() if k != "--threads"}.items() <= options(ran).items()
    header = next(line for line in page.split(block)[1].splitlines() if line.strip().startswith("rows "))
    printed = next(line for line in (out / "logs" / "rows-lm.log").read_text().splitlines()
                   if line.strip().startswith("rows "))
    assert set(re.split(r"\s{2,}", header.strip())) <= set(re.split(r"\s{2,}", printed.strip()))


@pytest.mark.slow
def test_two_ranks_with_graphs_equal_one_rank_with_twice_the_batch(checked):
    _, report, markdown, _ = checked
    figures = report["steps"][-1]["figures"]
    assert figures["backend"] == "gloo" and figures["largest parameter difference"] <= 1e-5
    assert all(figures["graphs captured (one rank, rank 0 of two)"])
    assert figures["NCCL"].startswith(NOT_MEASURED)
    assert f"| NCCL | {NOT_MEASURED} (gloo on the CPU) |" in markdown


@pytest.mark.slow
def test_the_report_names_the_machine_and_every_figure_its_machine(checked):
    _, report, markdown, _ = checked
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["device"].startswith("CPU: ")
    assert markdown.startswith("# feedback-gpu-check: PASSED\n")
    device = report["machine"]["device"]
    for record in report["steps"]:
        section = re.split(rf"^#+ {record['step']}\. ", markdown, flags=re.M)[1]
        assert section.split("\n")[4].startswith(f"On {device}"), record["step"]  # after the result line


@pytest.mark.slow
def test_the_commands_of_docs_gpu_check_md_are_the_ones_run_here(checked):
    """The page's CPU command is the run above (its --updates and --out apart); its GPU command, a template."""
    _, report, _, _ = checked
    page = open(os.path.join(REPO, "docs/gpu-check.md")).read()
    blocks = re.findall(r"<!-- (.*?) -->\n```bash\n(.*?)```", page, flags=re.S)
    assert blocks == [("template: needs a CUDA GPU", "feedback-gpu-check --out gpu-check\n"),
                      ("run by tests/test_gpu_check.py", "feedback-gpu-check --device cpu --cuda-graphs emulate\n")]
    assert report["command"][:5] == blocks[1][1].split()


# --- the run's rules, with steps that stand in for the real ones -------------------------------------


def step(key, run, estimate=0):
    return Step(key, f"step {key}", {"tiny": estimate, "full": estimate}, run)


def passes(check):
    return Outcome("fine", {"figure": 1.0}, [f"On {check.machine['device']}: fine."])


def check_with(steps, tmp_path, *args):
    with mock.patch.object(cli, "STEPS", steps):
        return run_module("fairseq_feedback_cli.gpu_check.cli", "--device", "cpu", "--out", tmp_path / "out", *args,
                          check=False)


def report_of(tmp_path):
    return json.loads((tmp_path / "out" / "report.json").read_text())


def test_a_failing_step_makes_the_exit_non_zero_and_names_it_and_the_later_steps_still_run(tmp_path):
    def losses_apart(check):
        raise StepFailed("fp16: the losses with and without graphs differ by 0.412 at update 120")

    proc = check_with([step("1", passes), step("2", losses_apart), step("3a", passes)], tmp_path)
    assert proc.returncode == 1
    assert re.fullmatch(r"error: failed in [\d.]+ min: step 2 \(step 2: fp16: the losses with and without graphs "
                        r"differ by 0\.412 at update 120\); the report: .*/out/report\.md\n", proc.stderr)
    report = report_of(tmp_path)
    assert [r["status"] for r in report["steps"]] == ["passed", "failed", "passed"]
    assert report["status"] == "failed" and report["exit status"] == 1
    assert (tmp_path / "out" / "report.md").read_text().startswith("# feedback-gpu-check: FAILED: 2\n")


def test_a_step_that_raises_is_a_failure_with_its_traceback_kept(tmp_path):
    def broken(check):
        return {}["missing"]

    proc = check_with([step("1", broken), step("2", passes)], tmp_path)
    assert proc.returncode == 1 and "step 1 (step 1: KeyError: 'missing' (logs/step-1-traceback.log))" in proc.stderr
    assert "Traceback" in (tmp_path / "out" / "logs" / "step-1-traceback.log").read_text()
    assert report_of(tmp_path)["steps"][1]["status"] == "passed"


def test_a_command_that_fails_fails_its_step_with_its_error_line_and_parts_not_asked_for_are_not_run(tmp_path):
    def runs_a_command(check):
        check.run(Command("fairseq_cli.train", ["data-bin"], "train.log"))

    fails = ["sh", "-c", "echo warming up; echo 'error: the GPU caught fire'; exit 3"]
    with mock.patch(LAUNCHER, lambda module: fails):
        proc = check_with([step("1", passes), step("2", runs_a_command)], tmp_path, "--parts", "2,3")
    assert proc.returncode == 1
    assert "(step 2: fairseq-train failed (exit 3): error: the GPU caught fire (logs/train.log))" in proc.stderr
    first, second = report_of(tmp_path)["steps"]
    assert (first["status"], first["summary"]) == ("not run", "not asked for (--parts)")
    assert second["commands"] == ["fairseq-train data-bin"]
    proc = check_with([step("3a", passes), step("3d", passes)], tmp_path, "--parts", "3d")  # a part's step alone
    assert proc.returncode == 0 and [r["status"] for r in report_of(tmp_path)["steps"]] == ["not run", "passed"]


def test_fairseq_train_runs_side_by_side_in_one_save_dir_are_refused_before_either_starts(tmp_path):
    """fairseq-train writes and removes checkpoints/dummy as it starts, --no-save or not: two runs side by
    side in one folder removed each other's, and one failed at random (FileNotFoundError)."""
    def trains_twice(check):
        check.run(Command("fairseq_cli.train", ["data-bin", "--no-save"], "one.log"),
                  Command("fairseq_cli.train", ["data-bin", "--no-save"], "two.log"))

    def trains_apart(check):
        check.run(*[Command("fairseq_cli.train", ["data-bin", "--save-dir", name], f"{name}.log")
                    for name in ("one", "two")])
        return Outcome("both ran")

    passes_if_run = ["sh", "-c", "echo ran"]
    with mock.patch(LAUNCHER, lambda module: passes_if_run):
        proc = check_with([step("1", trains_twice), step("2", trains_apart)], tmp_path)
    first, second = report_of(tmp_path)["steps"]
    assert first["status"] == "failed" and first["summary"].startswith(
        "fairseq-train runs side by side share a --save-dir: ") and not first["logs"]
    assert second["status"] == "passed" and len(second["logs"]) == 2, proc.stderr


@pytest.mark.slow
def test_a_failing_gpu_test_fails_step_1_and_names_the_test(tmp_path):
    tests = probe_tests(tmp_path)
    with open(os.path.join(tests, "test_probe.py"), "a") as f:
        # an id with spaces, as the checkout's parameters have: named whole
        f.write("\n\n@pytest.mark.gpu\n@pytest.mark.parametrize('options', ['shared kv'])\n"
                "def test_a_graph_on_the_gpu(options):\n    assert False, 'replayed stale weights'\n")
    with mock.patch(CHECKOUT_TESTS, lambda: tests):
        proc = check_with([step("1", gpu_tests)], tmp_path)
    assert proc.returncode == 1
    assert ("step 1 (step 1: pytest exit 1: 1 failed, 1 passed, 1 skipped, 1 deselected; failed: "
            "tests/test_probe.py::test_a_graph_on_the_gpu[shared kv])") in proc.stderr
    assert checkout_tests() == os.path.join(REPO, "tests")  # from this checkout: its own


def test_a_loss_mismatch_or_graphs_that_did_not_run_fail_the_training_comparison():
    def log(*losses, graphs="", scales=()):
        """fairseq-train's JSON log: losses every 10 updates (with fp16's loss scales), a validation."""
        return graphs + "".join(
            f'x | INFO | train_inner | {{"num_updates": "{10 * i}", '
            + (f'"loss_scale": "{scales[i - 1]}", ' if scales else "") + f'"loss": "{loss}"}}\n'
            for i, loss in enumerate(losses, 1)) + 'x | INFO | valid | {"epoch": 1, "valid_loss": "4.000"}\n'

    captured = "feedback loop: captured graph 1 for 8 rows\n"
    figures, failures = compare_training(log(6.0, 5.0, graphs=captured), log(6.0, 5.004), 0.01)
    assert not failures and figures["largest loss difference (bits/token)"] == pytest.approx(0.004)
    _, failures = compare_training(log(6.0, 5.0, graphs=captured), log(6.0, 5.004), 0.001)
    assert failures == ["the losses with and without graphs differ by 0.004 at update 20 (graphs 5.000, eager "
                        "5.004), more than the tolerance 0.001"]
    gave_up = "feedback loop: CUDA graph: no graphsafe_set_state; running eagerly from now on\n"
    _, failures = compare_training(log(6.0, 5.0, graphs=gave_up), log(6.0, 5.0, graphs=captured), 0.01)
    assert failures == [f"the graphs gave up, so both runs were eager: {gave_up.strip()}",
                        "--cuda-graphs off captured graphs"]
    _, failures = compare_training(log(6.0, 5.0), log(6.0, 5.0), 0.01)
    assert failures == ["no graph was captured"]
    with pytest.raises(StepFailed, match="^the runs with and without graphs logged different losses"):
        compare_training(log(6.0, 5.0, graphs=captured), log(6.0), 0.01)
    # fp16: one run alone skipped an update before update 30 (its loss scale halved): compared up to there
    figures, failures = compare_training(log(6.0, 5.0, 4.5, graphs=captured, scales=(128, 128, 128)),
                                         log(6.0, 5.0, 4.9, scales=(128, 128, 64)), 0.01)
    assert not failures and (figures["loss scalers parted at"], figures["points compared"]) == ("update 30", 2)
    with pytest.raises(StepFailed, match="^the loss scalers parted at update 10, before a loss could"):
        compare_training(log(6.0, graphs=captured, scales=(128,)), log(6.0, scales=(64,)), 0.01)


def test_too_few_updates_for_a_shape_to_come_twice_is_not_judged_rather_than_a_failure(tmp_path):
    """--updates 1 or 2 passed its checks, then always failed with "no graph was captured": a shape is
    captured at its second sighting, and no shape came twice. That is no failure of the graph path."""
    lines = ("graph cache | keys 1 | calls 1 | hits 0 | hit rate 0.0%", "graph cache | keys 3 | calls 2 | hits 0 | "
             "hit rate 0.0%")
    assert no_shape_repeated("\n".join(lines))
    assert not no_shape_repeated("graph cache | keys 2 | calls 3 | hits 0 | hit rate 0.0%")
    assert not no_shape_repeated("no line of the cache: its graphs were off")
    every_block_new = ["sh", "-c", f"echo '{lines[0]}'"]  # each command, fairseq-train's among them
    with mock.patch(LAUNCHER, lambda module: every_block_new):
        proc = check_with([step("2", training_comparison)], tmp_path, "--updates", 1)
    assert proc.returncode == 2, proc.stderr
    assert "; not judged: 2;" in proc.stdout.splitlines()[-1]
    (record,) = report_of(tmp_path)["steps"]
    assert record["status"] == "not judged" and record["summary"].startswith(
        "not judged: no batch shape came twice in 1 updates (fp32, fp16), so no graph could be captured")


def test_a_step_that_would_not_fit_is_skipped_for_time_and_said_so(tmp_path):
    proc = check_with([step("1", passes), step("2", passes, estimate=3600), step("3a", passes)], tmp_path)
    assert proc.returncode == 2
    assert "[2] skipped for time: needs about 3600 s, " in proc.stdout
    assert "passed 1, 3a; skipped or stopped for time: 2 (--minutes 13)" in proc.stdout.splitlines()[-1]
    report = report_of(tmp_path)
    assert report["status"] == "incomplete" and report["steps"][1]["seconds"] is None
    unlimited = tmp_path / "unlimited"  # --minutes inf was refused as "must be a number above 0, got inf"
    unlimited.mkdir()
    proc = check_with([step("1", passes), step("2", passes, estimate=3600)], unlimited, "--minutes", "inf")
    assert proc.returncode == 0 and "inf minutes" in proc.stdout, proc.stderr


def test_a_step_still_running_at_the_deadline_is_stopped(tmp_path):
    def sleeps(check):
        check.run(Command("sleep", [], "sleep.log"))

    with mock.patch(LAUNCHER, lambda module: ["sleep", "30"]):
        proc = check_with([step("1", sleeps), step("2", passes, estimate=1)], tmp_path, "--minutes", "0.02")
    assert proc.returncode == 2
    assert [(r["status"], r["seconds"] < 10) for r in report_of(tmp_path)["steps"][:1]] == [("stopped for time", True)]
    assert report_of(tmp_path)["steps"][1]["status"] == "skipped for time"


def test_away_from_a_checkout_the_tests_are_said_not_there_and_the_check_goes_on(tmp_path):
    with mock.patch(CHECKOUT_TESTS, lambda: None):
        proc = check_with([step("1", gpu_tests), step("2", passes)], tmp_path)
    assert proc.returncode == 0 and "[1] not run: the tests are not there" in proc.stdout
    assert "passed 2; not run: 1;" in proc.stdout.splitlines()[-1]


def test_an_interrupted_check_says_so_in_a_report_that_does_not_look_finished(tmp_path):
    def interrupted(check):  # as `timeout` stops a command: SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)

    proc = check_with([step("1", passes), step("2", interrupted), step("3a", passes)], tmp_path)
    assert proc.returncode == 1 and proc.stderr.startswith("error: interrupted during step 2; ")
    report = report_of(tmp_path)
    assert [r["status"] for r in report["steps"]] == ["passed", "interrupted", "not run"]
    assert (tmp_path / "out" / "report.md").read_text().startswith("# feedback-gpu-check: INTERRUPTED: 2\n")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # as before the check


def test_while_it_runs_the_report_says_so(tmp_path):
    seen = {}

    def looks(check):
        seen["md"] = open(check.path("report.md")).read()
        seen["json"] = json.load(open(check.path("report.json")))
        return passes(check)

    check_with([step("1", passes), step("2", looks)], tmp_path)
    assert seen["md"].startswith("# feedback-gpu-check: RUNNING (step 2; ")
    assert seen["json"]["status"] == "running" and seen["json"]["exit status"] is None
    assert not (tmp_path / "out.tmp").exists() and report_of(tmp_path)["status"] == "passed"


def test_a_folder_that_is_not_a_checks_is_never_replaced_and_bad_options_are_one_line(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "results.txt").write_text("mine")
    proc = check_with([step("1", passes)], tmp_path)
    assert proc.returncode == 1 and proc.stderr == (f"error: {tmp_path / 'out'} exists and is not a folder this "
                                                    "check wrote: pass another --out\n")
    assert (tmp_path / "out" / "results.txt").read_text() == "mine"
    for args, error in (
            (["--device", "cpu", "--cuda-graphs", "auto"], "--cuda-graphs auto runs no graphs on the CPU: pass "
                                                           "--cuda-graphs emulate"),
            (["--device", "cpu", "--parts", "2,5"], "argument --parts: the parts are 1, 2, 3 and 4, as in 1,2,3,4, "
                                                    "and a part's steps are 3a, 3b, 3c, 3d, 3e; got '2,5' (see --help)"),
            (["--device", "cpu", "--minutes", "0"], "--minutes must be a number above 0 (inf: no limit), got 0"),
            # nan compares false with everything: it skipped every step, or passed every loss
            (["--device", "cpu", "--minutes", "nan"], "--minutes must be a number above 0 (inf: no limit), got nan"),
            (["--device", "cpu", "--tolerance", "nan"], "--tolerance must be a number, 0 or above, got nan"),
            (["--device", "cpu", "--tolerance", "-0.1"], "--tolerance must be a number, 0 or above, got -0.1")):
        proc = run_module("fairseq_feedback_cli.gpu_check.cli", *args, check=False)
        assert proc.returncode == 1 and proc.stderr == f"error: {error}\n", proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_without_a_gpu_it_says_so_at_once_and_names_the_cpu_run():
    """The usual cause: a CPU build of torch."""
    proc = run_module("fairseq_feedback_cli.gpu_check.cli", check=False)
    assert proc.returncode == 1 and proc.stderr == (
        f"error: no CUDA GPU is visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}): install a "
        "CUDA build of torch, or pass --device cpu for the tiny run on the CPU\n")


def test_the_gpus_are_read_from_nvidia_smi():
    text = 2 * "NVIDIA H100 80GB HBM3, 550.54.15, 81559 MiB, Default\n"
    assert nvidia_smi_gpus(text) == 2 * [{"name": "NVIDIA H100 80GB HBM3", "driver": "550.54.15",
                                          "memory": "81559 MiB", "compute mode": "Default"}]


@pytest.mark.slow
def test_the_check_leaves_fairseqs_loggers_as_it_found_them(checked):
    """The check runs in the process that calls it (a test's): fairseq's
    tools run after it there must still log their progress lines."""
    assert logging.getLogger("fairseq").level == logging.NOTSET  # as fairseq leaves it
