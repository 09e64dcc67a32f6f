"""Step 4: two ranks with graphs on (NCCL on two GPUs; gloo sharing one GPU, or on the CPU)
against one rank with twice the batch: the same parameters after a few updates."""

import os

from .check import NOT_MEASURED, PLUGIN, Check, Command, Outcome, StepFailed, read
from .corpora import parallel_corpus
from .training import graphs_in, largest_difference, logged

# two ranks against one with twice the batch: parameters within atol + rtol * |parameter|
PARAMETER_TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def checkpoint_parameters(path: str) -> dict:
    import logging

    import torch

    # what fairseq's import logs is no progress line; the level is put back, for a process that
    # goes on to run fairseq's tools (a test's) and expects their progress lines
    fairseq_logger = logging.getLogger("fairseq")
    level = fairseq_logger.level
    fairseq_logger.setLevel(logging.WARNING)
    try:
        from fairseq_feedback.safe_checkpoints import fairseq_checkpoints_allowed
    finally:
        fairseq_logger.setLevel(level)

    with fairseq_checkpoints_allowed():
        return torch.load(path, map_location="cpu")["model"]


def two_ranks(check: Check) -> Outcome:
    """Two ranks of a batch each, and one rank of both batches (16
    sentences: one update is an epoch, so each update sees the same
    sentences either way), with graphs on and SGD (Adam would turn the float
    noise of gradients that are zero in exact arithmetic into full steps)."""
    sizes = check.sizes["two_ranks"]
    data = parallel_corpus(check, "two-ranks", ["--train", 2 * sizes["batch"], "--valid", 1, "--seed", 2])
    if check.on_cpu:
        backend, devices, where = "gloo", [None, None], "gloo on the CPU"
    elif gpus() >= 2:
        backend, devices, where = "nccl", [0, 1], "NCCL on GPUs 0 and 1"
    else:
        backend, devices, where = "gloo", [0, 0], "gloo, both ranks on GPU 0, the only GPU"
    common = [data, "--user-dir", PLUGIN, "--task", "translation", *sizes["model"], "--optimizer", "sgd", "--lr", 0.25,
              "--required-batch-size-multiple", 1, "--max-update", sizes["updates"], "--ddp-backend", "legacy_ddp",
              "--cuda-graphs", check.graphs, "--disable-validation", "--no-epoch-checkpoints", "--log-format", "json",
              "--log-interval", 1, "--seed", 1, "--num-workers", 0, *check.device_flags()]
    save = {count: check.path("work", "two-ranks", f"{count}-rank") for count in (1, 2)}
    one = Command("fairseq_cli.train", [*common, "--batch-size", 2 * sizes["batch"], "--save-dir", save[1]],
                  "two-ranks-one-rank.log")
    ranks = [Command("fairseq_cli.train", [*common, "--batch-size", sizes["batch"], "--save-dir", save[2],
                                           "--distributed-world-size", 2, "--distributed-rank", rank,
                                           "--distributed-backend", backend, "--distributed-init-method",
                                           f"file://{check.path('work', 'two-ranks', 'rendezvous')}",
                                           "--distributed-no-spawn",
                                           *([] if device is None else ["--device-id", device])],
                     f"two-ranks-rank{rank}.log") for rank, device in enumerate(devices)]
    check.run(one, *ranks)
    logs = [read(check.path("logs", command.log)) for command in (one, *ranks)]
    if "training on 2 devices" not in logs[1]:
        raise StepFailed(f"the two ranks did not train as one job (logs/{ranks[0].log})")
    expected, got = (checkpoint_parameters(os.path.join(save[count], "checkpoint_last.pt")) for count in (1, 2))
    if got.keys() != expected.keys():
        raise StepFailed("two ranks saved other parameters than one rank")
    gaps = {name: (got[name].float() - expected[name].float()).abs() for name in expected}
    beyond = [name for name in expected if (gaps[name] > PARAMETER_TOLERANCE["atol"] + PARAMETER_TOLERANCE["rtol"]
                                            * expected[name].float().abs()).any()]
    largest = max(gap.max().item() for gap in gaps.values())
    loss_difference, at = largest_difference(logged(logs[1]), logged(logs[0]))
    captured = [graphs_in(log)[0] for log in logs[:2]]  # rank 1 logs warnings only, as fairseq's ranks do
    figures = {"backend": backend, "where": where, "batch per rank (sentences)": sizes["batch"],
               "updates": sizes["updates"], "largest parameter difference": largest,
               "tolerance": PARAMETER_TOLERANCE, "largest loss difference (bits/token)": loss_difference,
               "graphs captured (one rank, rank 0 of two)": captured,
               "NCCL": "used" if backend == "nccl" else f"{NOT_MEASURED} ({where})"}
    outcome = Outcome(
        f"{where}: parameters within {largest:.1e} of one rank's with twice the batch", figures,
        [f"On {check.machine['device']}, {where}: two ranks of {sizes['batch']} sentences each against one rank "
         f"of {2 * sizes['batch']}, {sizes['updates']} updates of SGD, `--cuda-graphs {check.graphs}`, "
         "`--ddp-backend legacy_ddp`.", "", "| | |", "|---|---|",
         f"| largest parameter difference | {largest:.2e} (allowed: {PARAMETER_TOLERANCE['atol']:g} + "
         f"{PARAMETER_TOLERANCE['rtol']:g} x the parameter) |",
         f"| largest loss difference | {loss_difference:.3f} bits/token at {at} |",
         f"| graphs captured: one rank, rank 0 of two | {', '.join(map(str, captured))} |",
         f"| NCCL | {figures['NCCL']} |"])
    if not all(captured):
        raise StepFailed(f"a run captured no graph (one rank, rank 0 of two: {captured})", outcome)
    if beyond:
        raise StepFailed("two ranks' parameters differ from one rank's with twice the batch: "
                         + ", ".join(f"{name} by {gaps[name].max().item():.2e}" for name in beyond), outcome)
    return outcome
