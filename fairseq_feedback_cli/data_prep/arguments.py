"""The command line every data script shares: where the raw files, the work and the output go, and
how many processes to use; the progress log; an interruption (Ctrl-C or SIGTERM) as one line."""

import argparse
import sys
from pathlib import Path
from typing import Callable

from fairseq_feedback_cli.command_line import ArgumentParser, check_at_least, command, fail
from fairseq_feedback_cli.machine import CORES, check_within, cores
from fairseq_feedback_cli.outputs import check_destination


def log(message: str) -> None:
    print(f"[data_prep] {message}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[], None]) -> None:
    command(main, interrupted="rerun the same command to resume")()


def make_parser(name: str, description: str) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description)
    p.add_argument("--raw", type=Path, help="folder holding the official archives, or the files extracted "
                   "from them (default: download the archives into the work dir)")
    p.add_argument("--dest", type=Path, default=Path("data-bin") / name,
                   help="binarized output for fairseq-train (default: %(default)s)")
    p.add_argument("--work", type=Path, help="intermediate files (default: data-raw/<dest name>, "
                   "beside the dest's parent folder)")
    p.add_argument("--workers", type=int, default=min(8, cores()),
                   help="processes for tokenization, BPE and fairseq-preprocess (default: %(default)s)")
    return p


def resolve_dirs(args: argparse.Namespace) -> None:
    args.dest = args.dest.resolve()
    if args.work is None:
        args.work = args.dest.parent.parent / "data-raw" / args.dest.name
    args.work = args.work.resolve()
    if args.raw is not None:
        args.raw = args.raw.resolve()
        if not args.raw.is_dir():
            fail(f"--raw {args.raw} is not a folder")
    check_within(args, workers=(1, cores(), CORES))  # as many processes: 100000 would exhaust the machine
    check_at_least(args, bpe_merges=1)  # subword-nmt learns 0 merges, then fails on the codes file it wrote
    check_destination(args.dest, "--dest", folder=True)
    check_destination(args.work, "--work", folder=True)
