"""feedback-benchmark: it runs, on the builders' models, in every dtype as fairseq trains in it, with every
tensor on the model's device; it counts the feedback loop's operators as a GPU replays it, reports what
capturing graphs cost apart from the rates, and names a model whose results are not finite."""

import contextlib
import io
import json
import math
import re
import sys
import tempfile
import time
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from fairseq.optim import FP16Optimizer
from helpers import make_dictionary, tiny_translation_model
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from fairseq_feedback.cuda_graphs import GraphFailure
from fairseq_feedback.loop.passes import Passes
from fairseq_feedback_cli import benchmark
from fairseq_feedback_cli.benchmark import breakdown, graphs, measure, operators, profile, rows, tables, workloads
from fairseq_feedback_cli.presets import PRESETS


class FactoriesNameTheirDevice(TorchFunctionMode):
    """Where a tensor factory (torch.full, torch.arange, torch.tensor, ...;
    the functions torch.set_default_device applies to) is called from this
    project's code without a device: on a GPU its tensor lands on the CPU,
    beside the model's CUDA tensors, which on the CPU nothing shows. A
    module's constructor is left out: `.to(device)` moves what it makes."""

    def __init__(self):
        super().__init__()
        self.unnamed = set()  # "file:line function" of each such call

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            caller = sys._getframe(1)  # the caller of the factory (a builtin: no frame of its own)
            in_a_constructor = caller.f_code.co_name == "__init__" and isinstance(caller.f_locals.get("self"),
                                                                                  torch.nn.Module)
            if caller.f_globals.get("__name__", "").startswith("fairseq_feedback") and not in_a_constructor:
                self.unnamed.add(f"{caller.f_code.co_filename}:{caller.f_lineno} torch.{func.__name__}")
        return func(*args, **kwargs)


# the tiny preset's blocks of 8 in one group, in 2 passes rather than 8 steps (in groups of 4, its 4
# passes dispatch as many operators as the 8 replayed steps: a pass runs the layers unfused)
PASSES = ["--train-passes", "2", "--pass-group", "8"]
IN_PASSES = "feedback_lm (passes 8x2)"
RUNS = {"fp32": ["--reference-loop"], "fp32, graphs through the stand-in": ["--cuda-graphs", "emulate"],
        "fp16": ["--dtype", "fp16"], "bf16": ["--dtype", "bf16"],
        "fp32, the LM also in passes": ["--only", "lm", *PASSES]}


class Runs(dict):
    """The tiny benchmark's output in each of RUNS, run when first asked
    for, the factory calls of this project's code that named no device
    while it ran, and what it wrote with --json."""

    def __missing__(self, name):
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as folder, FactoriesNameTheirDevice() as factories, \
                contextlib.redirect_stdout(out):
            benchmark.main(["--preset", "tiny", "--threads", "1", *RUNS[name], "--json", f"{folder}/figures.json"])
            with open(f"{folder}/figures.json") as f:
                written = json.load(f)
        self[name] = out.getvalue(), factories.unnamed, written
        return self[name]


@pytest.fixture(scope="module")
def runs():
    return Runs()


def table_rows(out):
    """{model: {column: cell}} of every table printed (cells are apart by two spaces or more)."""
    rows, columns = {}, None
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == "model":
            columns = cells[1:]
        elif not line.strip():
            columns = None
        elif columns is not None:
            rows[cells[0]] = dict(zip(columns, cells[1:]))
    return rows


def plain_adam(model):
    """The optimizer the benchmark once stepped fp16 weights with."""
    return workloads.TorchAdam([p for p in model.parameters() if p.requires_grad])


def test_the_benchmark_runs_on_the_same_builders(runs):
    """With --reference-loop, each feedback model also runs its loop through autograd, in a row of its own."""
    out, *_ = runs["fp32"]
    for row in ("transformer ", "feedback_transformer", "transformer_lm", "feedback_lm", "feedback / fairseq",
                "feedback_transformer (reference loop)", "feedback_lm (reference loop)"):
        assert row in out
    assert "(eager)" not in out and "capture s" not in out  # no graphs run on the CPU by default


@pytest.mark.half_precision
def test_fp16_and_bf16_run_on_the_cpu_with_every_figure_finite(runs):
    for dtype in ("fp16", "bf16"):
        out, *_ = runs[dtype]
        rows = table_rows(out)
        assert {"transformer", "feedback_transformer", "transformer_lm", "feedback_lm"} <= set(rows)
        for name, cells in rows.items():
            assert all(math.isfinite(float(cell)) and float(cell) > 0 for cell in cells.values()), (dtype, name, cells)


@pytest.mark.half_precision
def test_half_precision_keeps_fp32_master_weights_as_fairseq_does():
    """The cause of the NaN on a GPU: torch's Adam stepping fp16 weights
    (eps 1e-8 is 0 in fp16) turns them NaN at once; fairseq's FP16Optimizer,
    which the benchmark steps fp16 and bf16 with, keeps them finite and
    moves them."""
    d = make_dictionary()
    src, tgt = torch.randint(d.nspecial, len(d), (2, 8, 6))
    steps = {}
    for name, optimizer_for in (("plain Adam", plain_adam), ("fairseq", workloads.optimizer_for)):
        model, _ = tiny_translation_model(arch="transformer")
        model.half()
        before = [p.detach().clone() for p in model.parameters()]
        with mock.patch.object(workloads, "optimizer_for", optimizer_for):
            workloads.translation_training(model, d, src, tgt)()
        steps[name] = before, list(model.parameters())
    assert not all(torch.isfinite(p).all() for p in steps["plain Adam"][1])
    before, after = steps["fairseq"]
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    assert isinstance(workloads.optimizer_for(model).optimizer, FP16Optimizer)


def test_results_that_are_not_finite_end_the_run_in_one_line_naming_the_model_and_the_phase(capsys):
    """fp16 weights stepped by a plain Adam (as the benchmark once did) turn
    NaN: no rate is printed, and the one line names the model and phase."""
    with mock.patch.object(workloads, "optimizer_for", plain_adam), pytest.raises(SystemExit) as stopped:
        benchmark.main(["--preset", "tiny", "--threads", "1", "--dtype", "fp16", "--only", "lm"])
    assert re.fullmatch(r"error: transformer_lm: training gave values that are not finite, .*", str(stopped.value))
    assert "\n" not in str(stopped.value)
    assert "feedback / fairseq" not in capsys.readouterr().out


def test_weights_that_are_not_finite_stop_a_search_before_it_starts():
    """On a GPU, sampling from NaN log-probabilities ends in a device-side
    assert that names nothing: the weights are checked first."""
    model, _ = tiny_translation_model()
    src, lengths = torch.randint(4, 24, (2, 5)), torch.full((2,), 5)
    forward = lambda: model(src, lengths, src)[0]  # noqa: E731
    measure.check_before_search("feedback_transformer", "beam search", model, forward)
    with torch.no_grad():
        model.decoder.layers[0].fc1.weight[0, 0] = float("nan")
    with pytest.raises(measure.NotFinite, match="^feedback_transformer: its weights or logits are not finite "
                                                  "before beam search"):
        measure.check_before_search("feedback_transformer", "beam search", model, forward)


def test_the_capture_is_timed_apart_from_the_steady_calls():
    """A workload whose first two calls capture graphs (a stream's memory
    filling its span): warm-up goes on until a call captures none, the
    rate comes from the steady calls alone, and the capture's cost is what
    the capturing calls took beyond them."""
    statistics = SimpleNamespace(captured=0, failed=None)
    model = SimpleNamespace(graph_statistics=lambda: statistics)
    calls = []

    def work():
        calls.append(1)
        capturing = len(calls) <= 2
        statistics.captured += capturing
        time.sleep(0.15 if capturing else 0.01)
        return 100, torch.zeros(1)

    rates, capture = measure.interleaved_rates({"m": model}, {"m": work}, 3, "training", measure.FiniteResults())
    assert len(calls) == 2 + 1 + 3  # two capturing calls, one that captured nothing, three timed
    assert 100 / 0.05 < rates["m"] <= 100 / 0.01
    assert 0.2 < capture["m"] < 0.4  # 2 x (0.15 - 0.01), and sleeps that overran on a busy machine


def test_where_graphs_run_each_feedback_model_also_runs_eagerly_and_the_capture_is_reported_apart(runs):
    rows = table_rows(runs["fp32, graphs through the stand-in"][0])
    for graphed in ("feedback_transformer", "feedback_lm"):
        assert float(rows[graphed]["capture s"]) > 0 and float(rows[graphed]["graphs MB"]) > 0, rows[graphed]
        assert rows[f"{graphed} (eager)"]["capture s"] == rows[f"{graphed} (eager)"]["graphs MB"] == "-"
    for fairseqs in ("transformer", "transformer_lm"):
        assert rows[fairseqs]["capture s"] == rows[fairseqs]["graphs MB"] == "-"


def test_every_tensor_the_benchmark_makes_lies_on_the_models_device(runs):
    """No factory call of this project's code, run by the benchmark's
    workloads (training, evaluation, beam search, sampling, the incremental
    state, the graphs' path in training and decoding), names no device;
    those meant to stay on the CPU say so."""
    for name in RUNS:
        assert not runs[name][1], (name, sorted(runs[name][1]))
    with FactoriesNameTheirDevice() as factories:  # and such a call does show
        exec("torch.full((1,), 0)", {"__name__": "fairseq_feedback.probe", "torch": torch})
    assert len(factories.unnamed) == 1


def test_the_benchmark_counts_the_feedback_loop_as_a_gpu_replays_it():
    """On the CPU, ops/step of a feedback model is the graph path's, whose
    loop is the fused block: fewer operators than that path with the loop
    through autograd (measured here: 226 against 272 per step, the
    optimizer's included), and a few more than the fused block run eagerly
    (the graph path's padding and bookkeeping: 214)."""
    d = make_dictionary()
    model, _ = tiny_translation_model("--dropout", "0.1", layers=3)
    src, tgt = torch.randint(d.nspecial, len(d), (2, 8, 16))
    work = workloads.translation_training(model, d, src, tgt)
    graphed = model.decoder.graphed
    replayed, _ = operators.kernels_and_busy_share(model, work, 16, torch.device("cpu"))
    assert model.decoder.graphed is graphed  # the model runs as before (eagerly, on the CPU)
    with operators.CountOps() as eager:
        work()
    workloads.with_the_reference_loop(model)
    through_autograd, _ = operators.kernels_and_busy_share(model, work, 16, torch.device("cpu"))
    assert eager.count / 16 < replayed < 0.9 * through_autograd


def test_a_kernels_shapes_are_its_operators_though_cuda_runtime_calls_share_the_operators_ids():
    """A profile of a linear layer and a ReLU on a GPU, as the profiler lists it (by start time): its
    operators numbered by the profiler (1-4), its runtime calls and kernels by CUDA (2-3, the counter
    behind as views launch nothing), so that the launch of the ReLU's kernel has the number of addmm;
    and a kernel replayed from a graph, which no operator launched."""
    def event(id, name, start, end, device=DeviceType.CPU, linked=0, shapes=()):
        return FunctionEvent(id=id, name=name, thread=1, start_us=start, end_us=end, input_shapes=list(shapes),
                             device_type=device, linked_correlation_id=linked)

    events = [event(1, "aten::linear", 0, 20, shapes=[[8, 64], [32, 64], [32]]),
              event(2, "aten::t", 1, 2, shapes=[[32, 64]]),
              event(3, "aten::addmm", 3, 19, shapes=[[32], [8, 64], [64, 32]]),
              event(2, "cudaLaunchKernel", 10, 12, linked=3),
              event(2, "ampere_sgemm_32x32_nn", 13, 18, DeviceType.CUDA, linked=3),
              event(4, "aten::relu", 21, 30, shapes=[[8, 32]]),
              event(3, "cudaLaunchKernel", 25, 27, linked=4),
              event(3, "vectorized_elementwise_kernel", 28, 29, DeviceType.CUDA, linked=4),
              event(9, "fused_feedback_step", 31, 35, DeviceType.CUDA)]
    assert profile.kernels_and_their_shapes(events) == [
        ("ampere_sgemm_32x32_nn", 5, "addmm 32, 8x64, 64x32"),
        ("vectorized_elementwise_kernel", 1, "relu 8x32"),
        ("fused_feedback_step", 4, "(replayed from a graph)")]


def test_the_breakdown_adds_up_to_the_ops_per_step_column(capsys):
    """What --breakdown lists, in the loop and out of it, sums to ops/step,
    and the loop's operators grow with the steps (a block of 16 steps
    against one of 8)."""
    benchmark.main(["--preset", "tiny", "--threads", "1", "--breakdown", "--only", "translation"])
    out = capsys.readouterr().out
    loop = [float(v) for v in re.search(r"in the loop, per step\s+([\d.]+)\s+([\d.]+)", out).groups()]
    outside = [float(v) for v in re.search(r"outside the loop, per target step\s+([\d.]+)\s+([\d.]+)", out).groups()]
    optimizer = float(re.search(r"optimizer \(Adam\), per target step\s+([\d.]+)", out).group(1))
    total = float(re.search(r"total per target step \(ops/step\)\s+([\d.]+)", out).group(1))
    assert all(v > 0 for v in loop)
    figures = len(loop) + len(outside) + 2  # each printed to a tenth: off by 0.05 at most
    assert abs(sum(loop) + sum(outside) + optimizer - total) <= 0.05 * figures + 1e-9
    p = PRESETS["tiny"]["translation"]
    d = make_dictionary(p["vocab"])
    model = workloads.build_translation_model("feedback_transformer", p, d, seed=1)
    g = torch.Generator().manual_seed(1)
    batch = [workloads.random_tokens(d, breakdown.BREAKDOWN_ROWS, p["length"], g) for _ in range(2)]
    work = workloads.translation_training(model, d, *batch)
    column = operators.counted_as_a_gpu_replays_it(model, work).count / p["length"]
    assert abs(column - total) < 0.1
    # a steady replay's operators: no capture, no check's eager pass (a call after many)
    with graphs.loop_as_a_gpu_replays_it(model):
        for _ in range(measure.WARM_UP_CALLS):
            work()
        with operators.CountOps() as steady:
            work(steady)
    assert steady.count / p["length"] == column


def test_the_json_holds_every_figure_of_the_tables_with_the_machine(runs):
    out, _, written = runs["fp32, graphs through the stand-in"]
    rows = table_rows(out)
    assert set(written["tables"]) == {"translation", "lm"} and written["machine"]["torch"] == torch.__version__
    for table in written["tables"].values():
        for column, by_model in table["figures"].items():
            for model, value in by_model.items():
                assert rows[model][column] == tables.FORMATS.get(column, "{:.1f}").format(value), (column, model)
        theirs, ours = table["models"][:2]
        assert table["feedback / fairseq"]["train tok/s"] == pytest.approx(
            table["figures"]["train tok/s"][ours] / table["figures"]["train tok/s"][theirs])
    # peak memory is the allocator's (CUDA): on the CPU it says so, rather than printing a number
    assert written["tables"]["translation"][tables.NOT_MEASURED] == ["peak train MB", "peak beam MB"]
    assert "peak train MB" not in out


class Allocator:
    """A device's allocated bytes and their peak since the last reset, as torch.cuda keeps them."""

    def __init__(self):
        self.current = self.high = 0

    def allocated(self):
        return self.current

    def peak(self):
        return self.high

    def reset_peak(self):
        self.high = self.current

    def change(self, nbytes):
        self.current += nbytes
        self.high = max(self.high, self.current)


def test_each_models_peak_memory_is_its_own_though_the_models_share_the_device():
    """Model a's weights (100 bytes) and b's (50) are on the device
    together; a's call leaves 10 bytes of optimizer state and takes 30
    more for a while: a alone would peak at 100 + 10 + 30, b's weights
    apart; b's call, after, peaks at its own 50 and 5 more."""
    allocator = Allocator()
    memory = measure.PeakMemory(allocator)
    for model, weights in (("a", 100), ("b", 50)):
        with memory.charged(model):
            allocator.change(weights)
    with memory.charged("a", "training"):
        allocator.change(+10)
        allocator.change(+30)
        allocator.change(-30)
    with memory.charged("b", "training"):
        allocator.change(+5)
        allocator.change(-5)
    with memory.charged("a", "training"):  # a steady call: no higher
        allocator.change(+20)
        allocator.change(-20)
    assert memory.column("training") == {"a": 140 / 2**20, "b": 55 / 2**20}
    assert memory.resident == {"a": 110, "b": 50}
    assert measure.PeakMemory().column("training") is None  # off CUDA: not measured


def test_the_first_batches_count_every_capture_and_each_new_shapes_cost():
    """Three batches of a graphed model: the first sighting of a shape runs
    eagerly (0.05 s), the next two calls capture (0.15 s each), and the
    second pass over the batches replays (0.01 s a call): the first
    batches' rate counts all of the first pass; each of the two shapes
    cost what the first pass took beyond the second, halved."""
    statistics = SimpleNamespace(captured=0, failed=None)
    graphed = SimpleNamespace(graph_statistics=lambda: statistics)
    eager = SimpleNamespace(decoder=SimpleNamespace())
    calls = []

    def work():
        calls.append(1)
        capturing = len(calls) in (2, 3)
        statistics.captured += capturing
        time.sleep(0.05 if len(calls) == 1 else 0.15 if capturing else 0.01)
        return 100, torch.zeros(1)

    def eager_work():
        time.sleep(0.01)
        return 100, torch.zeros(1)

    rates, per_shape = measure.first_batches({"graphed": graphed, "eager": eager},
                                               {"graphed": work, "eager": eager_work}, 3, measure.FiniteResults())
    assert len(calls) == 6  # two passes: the second captured nothing
    assert 300 / 0.6 < rates["graphed"] <= 300 / 0.35 and 300 / 0.1 < rates["eager"] <= 300 / 0.03
    assert per_shape.keys() == {"graphed"} and 0.14 < per_shape["graphed"] < 0.3  # (0.35 - 0.03) / 2


# --- speed against rows ---------------------------------------------------------------------------------

def test_each_models_fastest_batch_fits_the_memory_budget_and_the_ratio_is_of_the_two_bests():
    """--rows: each model at the batch where it trains fastest, among those
    whose peak fits --memory-budget and whose graphs did not give up (their
    rows would be an eager model's); a batch that ran out of memory counts
    for neither."""
    def batch(n, fairseq, feedback, gave_up=None):
        return {"rows": n, "figures": {
            "t": {"train tok/s": fairseq[0], "peak MB": fairseq[1], "graphs gave up": None},
            "f": {"train tok/s": feedback[0], "peak MB": feedback[1], "graphs gave up": gave_up}}}

    batches = [batch(8, (100, 10), (50, 20)), batch(32, (120, 40), (90, 80)),
               {"rows": 128, "out of memory": "CUDA out of memory"}]
    best = rows.fastest(batches, ["t", "f"], budget=50 * 2**20)
    assert (best["t"]["rows"], best["f"]["rows"], best["feedback / fairseq"]) == (32, 8, 50 / 120)
    assert rows.fastest(batches, ["t", "f"], budget=None)["feedback / fairseq"] == 90 / 120
    batches[1] = batch(32, (120, 40), (90, 80), gave_up="out of memory in capture")
    assert rows.fastest(batches, ["t", "f"], budget=None)["f"]["rows"] == 8
    assert rows.fastest(batches, ["t", "f"], budget=2**20)["feedback / fairseq"] is None  # f fits no batch


def test_a_feedback_step_reads_the_loops_weights_at_every_step_and_the_memory_over_the_span():
    """The bytes a training step must read: fairseq's model its weights once
    (forward and backward), whatever the rows; the feedback model the loop's
    weights at every step, and in each layer the keys and values of its
    memory (from m_{-1} at the start of a block, or over the whole span when
    carried) and of the source, more with every row. Where its blocks run
    from graphs (on a GPU, or through the stand-in), at their bucket's
    shape: padded rows, steps and source positions are read as real ones;
    graphs that gave up leave the real shape."""
    transformer, _ = tiny_translation_model(arch="transformer")
    feedback, d = tiny_translation_model("--memory-span", "4")
    weights = sum(t.numel() * t.element_size() for t in transformer.parameters())
    assert rows.bytes_read(transformer, 8, 2, False, 5) == rows.bytes_read(transformer, 8, 64, False, 5) == 2 * weights
    decoder = feedback.decoder
    loop = sum(t.numel() * t.element_size() for t in [*decoder.memory.parameters(), *decoder.layers.parameters()])
    slot, layers = 2 * decoder.memory.num_heads * decoder.memory.head_dim * 4, len(decoder.layers)  # k and v, fp32
    read = lambda steps, n, carried=False: rows.bytes_read(feedback, steps, n, carried, 5)  # noqa: E731
    from_m_minus_1 = sum(min(t + 1, 4) for t in range(8))  # 1, 2, 3, 4, 4, ...
    assert read(8, 3) - read(8, 2) == 2 * layers * slot * (from_m_minus_1 + 8 * 5)
    assert read(8, 2, carried=True) - read(8, 2) == 2 * 2 * layers * slot * (8 * 4 - from_m_minus_1)
    assert read(16, 2, True) - read(8, 2, True) == 2 * 8 * (loop + 2 * layers * slot * (4 + 5))
    eager = read(7, 2)
    decoder.use_cuda_graphs("emulate")
    src, prev = torch.randint(d.nspecial, len(d), (2, 5)), torch.randint(d.nspecial, len(d), (2, 7))
    feedback(src, torch.full((2,), 5), prev)  # the graphs start
    weights = sum(t.numel() * t.element_size() for t in feedback.parameters())
    # 7 steps padded to 8, 2 rows to 8 and 5 source positions to 8; the span of 4 (its window) as it is
    assert read(7, 2) == 2 * (weights - loop + 8 * loop + layers * 8 * slot * (from_m_minus_1 + 8 * 8))
    decoder.graphed.cache.fail("", GraphFailure("gave up"))
    assert read(7, 2) == eager


@pytest.mark.parametrize("args, error", [
    (["--rows", "0,8"], "argument --rows: rows are whole numbers of 1 or more, as in 8,32,128; got '0,8'"),
    (["--rows", "8,x"], "argument --rows: rows are whole numbers of 1 or more, as in 8,32,128; got '8,x'"),
    (["--rows", "8", "--memory-budget", "0"], "--memory-budget must be a number above 0, got 0"),
    (["--rows", "8", "--bandwidth", "nan"], "--bandwidth must be a number above 0, got nan")])
def test_bad_rows_budgets_and_bandwidths_are_one_line(args, error):
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(["--preset", "tiny", *args])
    assert str(stopped.value) in (f"error: {error}", f"error: {error} (see --help)")



# --- training in passes ---------------------------------------------------------------------------------

def test_train_passes_adds_each_feedback_model_trained_in_passes_with_its_ratio_to_fairseqs(runs):
    """--train-passes 2 --pass-group 8: feedback_lm also trains in 2 passes
    over each block, in a row of its own (fewer operators per target step
    than exact feedback's 8 steps) and a line of its ratio to fairseq's
    under exact feedback's; --json holds both ratios."""
    out, _, written = runs["fp32, the LM also in passes"]
    rows = table_rows(out)
    assert float(rows[IN_PASSES]["ops/step"]) < float(rows["feedback_lm"]["ops/step"])
    table = written["tables"]["lm"]
    assert table["models"] == ["transformer_lm", "feedback_lm", IN_PASSES]
    for name, ratio in (("feedback_lm", "feedback / fairseq"), (IN_PASSES, f"{IN_PASSES} / fairseq")):
        for column, value in table[ratio].items():
            rates = table["figures"][column]
            assert value == pytest.approx(rates[name] / rates["transformer_lm"])
            assert rows[ratio][column] == f"{value:.2f}", (ratio, column)


def test_with_rows_the_model_in_passes_trains_at_each_batch_and_at_its_fastest(capsys, tmp_path):
    """--rows with --train-passes: the model in passes has a row at each
    batch, with its own ratio to fairseq's in the "feedback / fairseq"
    column (whose key in the batch stays exact feedback's), fewer
    operators and bytes per step than exact feedback, its fastest batch
    and ratio there; --json holds them."""
    benchmark.main(["--preset", "tiny", "--threads", "1", "--only", "lm", "--rows", "2,4", *PASSES,
                    "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    with open(tmp_path / "rows.json") as f:
        sweep = json.load(f)["rows"]["lm"]
    assert sweep["models"] == ["transformer_lm", "feedback_lm", IN_PASSES]
    for batch in sweep["batches"]:
        figures = batch["figures"]
        rate = {name: figures[name]["train tok/s"] for name in sweep["models"]}
        assert batch["feedback / fairseq"] == pytest.approx(rate["feedback_lm"] / rate["transformer_lm"])
        for name in ("feedback_lm", IN_PASSES):
            assert figures[name]["feedback / fairseq"] == pytest.approx(rate[name] / rate["transformer_lm"])
        for column in ("ops/step", "MB read/step"):
            assert figures[IN_PASSES][column] < figures["feedback_lm"][column], column
        printed = re.search(rf"^\s+{batch['rows']}\s+{re.escape(IN_PASSES)}\s+[\d,.]+\s+(\d+\.\d\d)\s", out, re.M)
        assert printed.group(1) == f"{figures[IN_PASSES]['feedback / fairseq']:.2f}"
    best = sweep["best"]
    assert best[IN_PASSES]["feedback / fairseq"] == pytest.approx(
        best[IN_PASSES]["train tok/s"] / best["transformer_lm"]["train tok/s"])
    assert best["feedback / fairseq"] == best["feedback_lm"]["feedback / fairseq"]
    (line,) = [line for line in out.splitlines() if line.startswith("each at its fastest batch")]
    assert f", {IN_PASSES} {best[IN_PASSES]['rows']} rows (" in line
    assert line.endswith(f"; feedback / fairseq {best['feedback / fairseq']:.2f}, "
                         f"{IN_PASSES} / fairseq {best[IN_PASSES]['feedback / fairseq']:.2f}")


def test_a_step_in_passes_reads_the_loops_weights_and_the_memory_once_a_pass():
    """Passes K = 2 over groups of G = 3 of 8 steps (groups from 0, 3 and 6,
    of 3, 3 and 2 positions): the loop's weights 3 x 2 times, and in each
    layer, row and pass the slots before the group (from m_{-1}, at most
    the span of 4; carried: the span) and the group's own but its last, and
    the source's 5 positions."""
    feedback, _ = tiny_translation_model("--memory-span", "4")
    decoder = feedback.decoder
    weights = sum(t.numel() * t.element_size() for t in feedback.parameters())
    loop = sum(t.numel() * t.element_size() for t in [*decoder.memory.parameters(), *decoder.layers.parameters()])
    slot, layers = 2 * decoder.memory.num_heads * decoder.memory.head_dim * 4, len(decoder.layers)  # k and v, fp32
    decoder.train_in_passes(Passes(2, 3))
    decoder.use_cuda_graphs("emulate")  # passes run eagerly, at the real rows, graphs or not
    from_m_minus_1 = 2 * ((1 + 2) + (4 + 2) + (4 + 1))
    carried = 2 * ((4 + 2) + (4 + 2) + (4 + 1))
    for memory, slots in ((False, from_m_minus_1), (True, carried)):
        assert rows.bytes_read(feedback, 8, 2, memory, 5) == 2 * (
            weights - loop + 6 * loop + layers * 2 * slot * (slots + 6 * 5)), memory


@pytest.mark.parametrize("args, error", [
    (["--train-passes", "0"], "--train-passes must be at least 1, got 0"),
    (["--train-passes", "2", "--pass-group", "0"], "--pass-group must be at least 1, got 0"),
    (["--train-passes", "5", "--pass-group", "4"], "--train-passes 5 is more than --pass-group 4: 4 passes already "
                                                   "compute a group exactly; use at most 4"),
    (["--train-passes", "17"], "--train-passes 17 is more than --pass-group 16: 16 passes already compute a group "
                               "exactly; use at most 16"),
    (["--pass-group", "4"], "--pass-group 4 is the group of --train-passes: add --train-passes, or drop --pass-group"),
    (["--train-passes", "2", "--breakdown"], "--breakdown counts exact feedback's operators, not those of training in "
                                             "passes: drop --train-passes or --breakdown"),
    # the language model alone: Figure 9's at CPU scale (docs/passes.md)
    (["--preset", "bytes"], "--preset bytes has no translation sizes: add --only lm"),
    (["--preset", "bytes", "--only", "translation"], "--preset bytes has no translation sizes: add --only lm")])
def test_bad_passes_are_one_line_before_any_model_is_built(args, error, capsys):
    with pytest.raises(SystemExit) as stopped:
        benchmark.main(["--preset", "tiny", *args] if "--preset" not in args else args)
    assert str(stopped.value) == f"error: {error}"
    assert capsys.readouterr().out == ""  # not the models' own refusal, once a model is built
