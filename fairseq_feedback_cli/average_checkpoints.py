"""feedback-average-checkpoints: average the parameters of fairseq checkpoints.

The same semantics as fairseq's scripts/average_checkpoints.py, which its pip
package does not install:

    feedback-average-checkpoints --inputs DIR --num-epoch-checkpoints 10 --output avg.pt
    feedback-average-checkpoints --inputs DIR --num-update-checkpoints 10 --output avg.pt
    feedback-average-checkpoints --inputs a.pt b.pt c.pt --output avg.pt

With --num-epoch-checkpoints N the last N of DIR's checkpoint<EPOCH>.pt are
averaged, with --num-update-checkpoints N the last N of its
checkpoint_<EPOCH>_<UPDATE>.pt (--checkpoint-upper-bound leaves out later
ones). The output is the newest input's checkpoint (options, training state)
with the model's parameters replaced by their mean: floating-point ones
averaged in float64 and stored in their own type (float32 for float16 and
bfloat16 ones, as fairseq does), integer ones floor-divided.

Checkpoints are read as every tool reads them (fairseq_feedback.checkpoint_files):
with torch's weights_only loading, with exactly the classes fairseq stores
allowed (fairseq_feedback.safe_checkpoints), so a file holding anything else is
refused rather than run, and a file that is no checkpoint is named in one line. The output is written to
OUTPUT.tmp and renamed into place, so it is never half written. Mistakes
end with one line naming them, never a traceback.
"""

import argparse
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from .command_line import ArgumentParser, check_at_least, command, fail
from .outputs import atomic_file, check_destination

EPOCH = re.compile(r"checkpoint(\d+)\.pt")
UPDATE = re.compile(r"checkpoint_\d+_(\d+)\.pt")


def last_checkpoints(folder: str, n: int, update_based: bool, upper_bound: Optional[int] = None) -> List[str]:
    """The newest n checkpoints of `folder`, newest first."""
    if not os.path.isdir(folder):
        fail(f"--inputs {folder} is not a folder (with --num-*-checkpoints, --inputs takes the save dir)")
    pattern = UPDATE if update_based else EPOCH
    found = []
    for name in os.listdir(folder):
        match = pattern.fullmatch(name)
        if match and (upper_bound is None or int(match.group(1)) <= upper_bound):
            found.append((int(match.group(1)), name))
    found.sort(reverse=True)
    if len(found) < n:
        kind = "checkpoint_<epoch>_<update>.pt" if update_based else "checkpoint<epoch>.pt"
        bound = f" up to {upper_bound}" if upper_bound is not None else ""
        hint = (" (save them with --save-interval-updates)" if update_based
                else " (fairseq-train writes them unless --no-epoch-checkpoints; keep them with --keep-last-epochs)")
        fail(f"found {len(found)} {kind} files{bound} in {folder}, need {n}{hint}")
    return [os.path.join(folder, name) for _, name in found[:n]]


def load(path: str) -> dict:
    from fairseq_feedback import checkpoint_files

    if not os.path.exists(path):
        fail(f"checkpoint {path} not found")
    # torch's weights-only loading, with exactly the classes fairseq stores allowed
    return checkpoint_files.read(path, mmap=False)


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def check_one_model(path: str, state: dict, first_path: str, first_state: dict) -> None:
    """Two checkpoints average into a model only if they are checkpoints of
    one: of one architecture, with the options that make the model (all but
    those that may change when a run resumes: fairseq_fixes/trained_options.py),
    and with the same dictionaries, symbol for symbol (their parameters fit
    either way, and fairseq averaged them into a model of nothing)."""
    from fairseq_feedback.fairseq_fixes.checkpoints import configuration
    from fairseq_feedback.fairseq_fixes.trained_options import other_model
    from fairseq_feedback.models.plugin_model import model_class

    first, this = configuration(first_state), configuration(state)
    if first is None or this is None:
        return
    model = model_class(first.model)
    if model_class(this.model) is not model:
        fail(f"{path} holds another architecture than {first_path}: average checkpoints of one model only")
    differ = None if model is None else other_model(model, first.model, this.model)
    if differ:
        fail(f"{path} was trained with {differ[1]}, and {first_path} with {differ[0]}: average checkpoints of one "
             "model only")
    first_dictionaries, dictionaries = _dictionaries(first.task), _dictionaries(this.task)
    for name in sorted(set(first_dictionaries) & set(dictionaries)):
        if first_dictionaries[name] != dictionaries[name]:
            same = "the same symbols in another order" if sorted(first_dictionaries[name]) == sorted(
                dictionaries[name]) else "other symbols"
            fail(f"{path} was trained with a {name} of {same} than {first_path}'s: the rows of its embeddings "
                 "are other words; average checkpoints trained on one data directory only")


def _dictionaries(task) -> Dict[str, List[str]]:
    """The symbols of each dictionary in the data directory a checkpoint was trained on, by file name (none
    where that directory is gone)."""
    from fairseq import utils

    data = getattr(task, "data", None) if isinstance(task, argparse.Namespace) else task.get("data")
    folder = utils.split_paths(data)[0] if data else None
    if folder is None or not os.path.isdir(folder):
        return {}
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("dict.") and name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                found[name] = [line.split(" ", 1)[0] for line in f]
    return found


def average(paths: List[str]) -> dict:
    """The first checkpoint, with its model parameters replaced by the mean over all of them."""
    import torch

    if not paths:
        fail("no checkpoints to average")
    first_state, sums, dtypes = None, OrderedDict(), {}
    for path in paths:
        state = load(path)
        params: Dict[str, torch.Tensor] = state["model"]
        if first_state is not None:
            check_one_model(path, state, paths[0], first_state)
        if first_state is None:
            first_state = state
            for name, p in params.items():
                if not torch.is_tensor(p):
                    fail(f"{path}: model entry {name} is not a tensor")
                dtypes[name] = p.dtype
                sums[name] = p.to(torch.float64 if p.is_floating_point() else torch.int64).clone()
            continue
        if set(params) != set(sums):
            missing, extra = set(sums) - set(params), set(params) - set(sums)
            fail(f"{path} has other parameters than {paths[0]}"
                 + (f" (missing: {_names(missing)})" if missing else "")
                 + (f" (extra: {_names(extra)})" if extra else "")
                 + ": average checkpoints of one model only")
        for name, p in params.items():
            if p.shape != sums[name].shape:
                fail(f"{path}: {name} has shape {tuple(p.shape)}, {paths[0]} {tuple(sums[name].shape)}: "
                     "average checkpoints of one model only")
            sums[name] += p.to(sums[name].dtype)
        del state, params
    n = len(paths)
    averaged = OrderedDict()
    for name, total in sums.items():
        dtype = dtypes[name]
        if total.is_floating_point():
            out_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            averaged[name] = (total / n).to(out_dtype)
        else:
            averaged[name] = torch.div(total, n, rounding_mode="floor").to(dtype)
    first_state["model"] = averaged
    return first_state


def save(state: dict, output: str) -> None:
    """A crash or a full disk leaves no half-written file (and the previous one, if any, in place)."""
    import torch

    if os.path.isdir(output):
        fail(f"--output {output} is a folder; name the file, e.g. {os.path.join(output, 'checkpoint.avg.pt')}")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with atomic_file(output, "wb") as f:  # a write the system refuses: one line (command_line.command)
        torch.save(state, f)


def check_not_a_checkpoint_of(folder: str, output: str) -> None:
    """The average of a save dir's last checkpoints goes beside them, not
    over one of the run's checkpoints (averaged or not: training made it)."""
    name = os.path.basename(output)
    trained = EPOCH.fullmatch(name) or UPDATE.fullmatch(name) or name in ("checkpoint_last.pt", "checkpoint_best.pt")
    if trained and os.path.exists(output) and os.path.samefile(os.path.dirname(os.path.abspath(output)), folder):
        fail(f"--output {output} would replace {name}, a checkpoint that training wrote in --inputs {folder}: "
             f"pass another name, as {os.path.join(folder, 'checkpoint.avg.pt')}")


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="feedback-average-checkpoints",
        description="Average the parameters of fairseq checkpoints (as fairseq's scripts/average_checkpoints.py).")
    p.add_argument("--inputs", nargs="+", required=True, metavar="PATH",
                   help="checkpoint files, or one save dir with --num-epoch-checkpoints/--num-update-checkpoints")
    p.add_argument("--output", required=True, metavar="FILE", help="where to write the averaged checkpoint")
    last = p.add_mutually_exclusive_group()
    last.add_argument("--num-epoch-checkpoints", type=int, metavar="N",
                      help="average the last N checkpoint<EPOCH>.pt of the --inputs folder")
    last.add_argument("--num-update-checkpoints", type=int, metavar="N",
                      help="average the last N checkpoint_<EPOCH>_<UPDATE>.pt of the --inputs folder")
    p.add_argument("--checkpoint-upper-bound", type=int, metavar="N",
                   help="with --num-*-checkpoints: ignore checkpoints after epoch (or update) N")
    return p


@command
def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    num = args.num_epoch_checkpoints or args.num_update_checkpoints
    # epochs and updates count from 1
    check_at_least(args, num_epoch_checkpoints=1, num_update_checkpoints=1, checkpoint_upper_bound=1)
    if num is not None:
        if len(args.inputs) != 1:
            fail("with --num-epoch-checkpoints or --num-update-checkpoints, --inputs takes one folder")
        paths = last_checkpoints(args.inputs[0], num, args.num_update_checkpoints is not None,
                                 args.checkpoint_upper_bound)
        check_not_a_checkpoint_of(args.inputs[0], args.output)
    else:
        if args.checkpoint_upper_bound is not None:
            fail("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
        paths = args.inputs
        folder = next((path for path in paths if os.path.isdir(path)), None)
        if folder is not None:
            fail(f"--inputs {folder} is a folder: pass --num-epoch-checkpoints N or --num-update-checkpoints N "
                 "to average its last N checkpoints")
    check_destination(args.output, "--output", reads={"--inputs": paths})  # the files, also those of a folder
    try:
        state = average(paths)
        save(state, args.output)
    except MemoryError:
        fail("out of memory while averaging")
    names = ", ".join(os.path.basename(path) for path in paths)
    print(f"averaged {len(paths)} checkpoints ({names}) into {args.output}")


if __name__ == "__main__":
    main()
