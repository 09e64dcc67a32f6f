"""feedback-benchmark: it runs, on the builders' models, and counts the feedback loop's operators as a GPU replays it."""

import re

import torch
from helpers import make_dictionary, tiny_translation_model

from fairseq_feedback_cli import benchmark


def test_the_benchmark_runs_on_the_same_builders(capsys):
    """With --reference-loop, each feedback model also runs its loop through autograd, in a row of its own."""
    benchmark.main(["--preset", "tiny", "--threads", "1", "--reference-loop"])
    out = capsys.readouterr().out
    for row in ("transformer ", "feedback_transformer ", "transformer_lm", "feedback_lm ", "feedback / fairseq",
                "feedback_transformer (reference loop)", "feedback_lm (reference loop)"):
        assert row in out


def test_the_benchmark_counts_the_feedback_loop_as_a_gpu_replays_it():
    """On the CPU, ops/step of a feedback model is the graph path's, whose
    loop is the fused block: fewer operators than that path with the loop
    through autograd (measured here: 226 against 272 per step, the
    optimizer's included), and a few more than the fused block run eagerly
    (the graph path's padding and bookkeeping: 214)."""
    d = make_dictionary()
    model, _ = tiny_translation_model("--dropout", "0.1", layers=3)
    src, tgt = torch.randint(d.nspecial, len(d), (2, 8, 16))
    work = benchmark.translation_training(model, d, src, tgt)
    replayed, _ = benchmark.kernels_and_busy_share(model, work, 16, torch.device("cpu"))
    assert model.decoder.graphed is None  # the model runs eagerly again
    with benchmark._CountOps() as eager:
        work()
    benchmark.with_the_reference_loop(model)
    through_autograd, _ = benchmark.kernels_and_busy_share(model, work, 16, torch.device("cpu"))
    assert eager.count / 16 < replayed < 0.9 * through_autograd


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
    assert abs(sum(loop) + sum(outside) + optimizer - total) < 0.1
    p = benchmark.PRESETS["tiny"]["translation"]
    d = benchmark.make_dictionary(p["vocab"])
    model = benchmark.build_translation_model("feedback_transformer", p, d, seed=1)
    g = torch.Generator().manual_seed(1)
    batch = [benchmark.random_tokens(d, benchmark.BREAKDOWN_ROWS, p["length"], g) for _ in range(2)]
    work = benchmark.translation_training(model, d, *batch)
    column = benchmark.counted_as_a_gpu_replays_it(model, work, warm_up=6).count / p["length"]
    assert abs(column - total) < 0.1
