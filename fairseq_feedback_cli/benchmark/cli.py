"""Speed of the feedback models as a ratio to fairseq's own models of the same size.

    feedback-benchmark                      # translation at base widths, and the LM
    feedback-benchmark --preset tiny        # seconds, to check that it runs
    feedback-benchmark --device cuda --dtype fp16 --preset iwslt   # IWSLT and feedback_lm_wiki103 sizes
    feedback-benchmark --reference-loop     # also the feedback models' loop through autograd
    feedback-benchmark --train-passes 4     # also the feedback models trained in passes (groups of 16)
    feedback-benchmark --rows 8,32,128      # instead: training against rows, and each model at its best

Translation: feedback_transformer against fairseq's transformer (training
target tokens/s, beam-5 output tokens/s, incremental-state bytes per decoded
token). Language modelling: feedback_lm against fairseq's transformer_lm
(training, evaluation and sampling tokens/s). Each pair is built through
fairseq's registry from the same options and runs the same random batches in
one process, the two models' calls interleaved, and each rate is taken from
the median call: the ratios compare architectures, not machines or moments.

On a GPU the feedback models replay their per-token loop as CUDA graphs, and
a third row runs them eagerly (--no-cuda-graphs) for comparison; the graphs'
rows say what capturing cost apart from the rates: the seconds that the calls
which captured graphs took beyond a steady call, and the graphs' memory
(--cuda-graphs emulate shows the same on the CPU, through the stand-in for
capture). Two more columns come from a profile of one training step: kernels
per target step (a position of every row; on the CPU: operators dispatched,
the count a GPU would launch, the feedback loop's as a GPU replays it) and
the share of the step's wall time during which the GPU runs a kernel.

With --train-passes K, each feedback model also trains in passes (the
models' --train-passes and --pass-group), in a row of its own:
"feedback_lm (passes 16x4)", groups of 16 positions, 4 passes each. Its
rates and kernels per target step, and its rates as a ratio to fairseq's
model, in a line under exact feedback's; it evaluates and decodes exactly.

With --rows, instead of the tables: each pair's training at each batch
(the LM with that many streams, translation with that many sentences a
batch): tokens/s, the ratio at that batch, peak memory (on a GPU), kernels
per step, and the bytes a step must read with the time they take at the
card's bandwidth; then each model at its fastest batch within
--memory-budget, and the ratio of the two (with --train-passes, the model
trained in passes too, with its ratio); and a profile of the exact feedback
model's training step at the smallest and the largest batch, kernel by
kernel (on the CPU: operator by operator).

fp16 and bf16 train as fairseq-train --fp16 and --bf16 do (fp32 master
weights, and for fp16 a dynamic loss scale), on any device. Every result is
checked to be finite before a rate is reported, and the weights and logits
before a search: one that is not ends the run in one line naming the model
and the phase.
"""

import argparse
import json
import platform
import sys
from typing import Optional

import torch

from fairseq_feedback.loop.passes import Passes
from fairseq_feedback.models.feedback_config import FeedbackConfig

from ..command_line import ArgumentParser, check_at_least, command, fail
from ..machine import CORES, SEEDS, check_within, cores
from ..outputs import atomic_file, check_destination
from ..presets import PRESETS
from .breakdown import BREAKDOWN_ROWS, breakdown
from .measure import NotFinite
from .rows import device_bandwidth, device_memory, sweep
from .tables import language_model, translation

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def rows_list(text: str) -> list:
    """--rows 8,32,128: batches of rows, each at least 1, in increasing order."""
    try:
        rows = sorted({int(n) for n in text.split(",")})
    except ValueError:
        rows = []
    if not rows or rows[0] < 1:
        raise argparse.ArgumentTypeError(f"rows are whole numbers of 1 or more, as in 8,32,128; got {text!r}")
    return rows


def machine(device: torch.device) -> dict:
    """What the figures were measured on."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}


def training_in_passes(args) -> Optional[Passes]:
    """How the extra rows train: --train-passes K over groups of --pass-group
    G (the models' default unless given), or None without --train-passes.
    Refused in one line: K above G (as the models refuse it), --pass-group
    alone, and --breakdown beside them (it counts exact feedback's operators)."""
    if args.train_passes is None:
        if args.pass_group is not None:
            fail(f"--pass-group {args.pass_group} is the group of --train-passes: add --train-passes, or drop "
                 "--pass-group")
        return None
    if args.breakdown:
        fail("--breakdown counts exact feedback's operators, not those of training in passes: drop --train-passes "
             "or --breakdown")
    group = FeedbackConfig.pass_group if args.pass_group is None else args.pass_group
    if args.train_passes > group:
        fail(f"--train-passes {args.train_passes} is more than --pass-group {group}: {group} passes already compute "
             f"a group exactly; use at most {group}")
    return Passes(args.train_passes, group)


@command
def main(argv=None):
    parser = ArgumentParser(prog="feedback-benchmark", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--only", choices=["translation", "lm"], help="run one of the two comparisons")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the models' parameters and activations; fp16 and bf16 train as fairseq-train --fp16 "
                             "and --bf16 do (fp32 master weights, and for fp16 a dynamic loss scale)")
    parser.add_argument("--cuda-graphs", choices=["auto", "off", "emulate"], default="auto",
                        help="the feedback models' --cuda-graphs: auto, graphs on a GPU; emulate, the graphs' path "
                             "through the stand-in for capture on any device. Where graphs run, each feedback model "
                             "also runs eagerly, and the capture's cost is reported apart")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the rates: the feedback models' operators per target step of a training "
                             f"step by kind, forward and backward, in the loop and per layer ({BREAKDOWN_ROWS} rows, "
                             "on the CPU, as a GPU replays the loop)")
    parser.add_argument("--reference-loop", action="store_true",
                        help="also run each feedback model with its loop step by step through autograd (the "
                             "reference loop, as before the fused block): what the fused block saves; with "
                             "--breakdown, the reference loop's operators instead")
    parser.add_argument("--train-passes", type=int, metavar="K",
                        help="also each feedback model trained in K passes over groups of --pass-group positions "
                             "(the models' --train-passes), in a row of its own beside exact feedback, with its "
                             "ratio to fairseq's model; with --rows, at each batch and at its fastest")
    parser.add_argument("--pass-group", type=int, metavar="G",
                        help="with --train-passes: the positions a pass computes at once, at least K (default "
                             f"{FeedbackConfig.pass_group}, the models' own)")
    parser.add_argument("--first-batches", type=int, default=0, metavar="N",
                        help="first, each model's rate over its first N training batches, every capture included "
                             "(translation: batches of fairseq's --max-tokens kind, of varied lengths; the language "
                             "model: its first N blocks), and the seconds each new shape cost a graphed model")
    parser.add_argument("--rows", type=rows_list, metavar="A,B,C",
                        help="instead of the tables: training at each of these batches (the LM's streams, "
                             "translation's sentences), each model at its fastest, and the feedback model's step "
                             "profiled at the smallest and the largest")
    parser.add_argument("--memory-budget", type=float, metavar="GB",
                        help="with --rows, the peak memory a batch may take to count as a model's fastest "
                             "(default: the GPU's memory; on the CPU peaks are not measured and every batch counts)")
    parser.add_argument("--bandwidth", type=float, metavar="GB/s",
                        help="with --rows, the memory bandwidth at which a step's bytes are timed (default: the "
                             "card's, where known)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure of the tables, by column and model, "
                                                       "with the machine, to FILE")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no GPU is visible to torch")
    check_at_least(args, first_batches=0, train_passes=1, pass_group=1)
    passes = training_in_passes(args)
    missing = [which for which in ("translation", "lm") if args.only in (None, which) and which not in PRESETS[args.preset]]
    if missing:
        fail(f"--preset {args.preset} has no {missing[0]} sizes: add --only "
             f"{'lm' if missing[0] == 'translation' else 'translation'}")
    check_within(args, threads=(1, cores(), CORES), seed=SEEDS)  # 100000 threads: a segmentation fault
    if args.json:
        check_destination(args.json, "--json")  # before the work, not once the tables are ready
    for option in ("memory_budget", "bandwidth"):
        value = getattr(args, option)
        if value is not None and not (value > 0 and value != float("inf")):
            fail(f"--{option.replace('_', '-')} must be a number above 0, got {value:g}")
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    print(f"torch {torch.__version__}, {where}, {args.dtype}, preset {args.preset}\n")
    if args.breakdown:
        breakdown(args.only, args.preset, args.seed, args.reference_loop)
        return
    tables, sweeps = {}, {}
    try:
        if args.rows:
            budget = device_memory(device) if args.memory_budget is None else int(args.memory_budget * 2**30)
            bandwidth = device_bandwidth(device) if args.bandwidth is None else args.bandwidth * 1e9
            for which in ("translation", "lm"):
                if args.only in (None, which):
                    sweeps[which] = sweep(which, PRESETS[args.preset][which], args.rows, args.seed, device, dtype,
                                          args.cuda_graphs, budget, bandwidth, passes)
        elif args.only in (None, "translation"):
            tables["translation"] = translation(PRESETS[args.preset]["translation"], args.seed, device, dtype,
                                                args.cuda_graphs, args.reference_loop, args.first_batches, passes)
        if not args.rows and args.only in (None, "lm"):
            tables["lm"] = language_model(PRESETS[args.preset]["lm"], args.seed, device, dtype, args.cuda_graphs,
                                          args.reference_loop, args.first_batches, passes)
    except NotFinite as error:
        fail(str(error))
    if args.json:
        with atomic_file(args.json) as f:
            json.dump({"command": ["feedback-benchmark", *sys.argv[1:]] if argv is None else
                       ["feedback-benchmark", *argv], "machine": machine(device), "dtype": args.dtype,
                       "preset": args.preset, "cuda_graphs": args.cuda_graphs,
                       "sizes": {name: PRESETS[args.preset][name] for name in (*tables, *sweeps)},
                       **({"rows": sweeps} if args.rows else {"tables": tables})}, f, indent=1)

