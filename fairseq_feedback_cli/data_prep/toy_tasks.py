"""Algorithmic toy tasks of the Feedback Transformer paper (Table 1, appendix 7.1, 7.4).

    python -m fairseq_feedback_cli.data_prep.toy_tasks TASK --out DIR --seed N [--train N ...] [task flags]

writes DIR/TASK/{train,valid,test}.{input,labels}: one episode per line, the two
files aligned token for token. The model reads the input stream (episodes joined
by an end-of-line token) and at each position i predicts labels[i]; `_` marks a
position with no loss. Answers are teacher forced: after the separator the input
holds the answer itself, so each label is the answer token the model must emit next.

    copy       3 1 4 = 3 1 4            _ _ _ 3 1 4 .
    reverse    3 1 4 = 4 1 3            _ _ _ 4 1 3 .
    counting   A A A = B B B            _ _ _ B B B .
    random_walk  reset F L F R ...      c36 c28 c28 c27 c27 ...   (cell after each token)
    algorithmic  x = 3 ; print x ; ...  _ _ _ _ _ _ 3 ...         (value at the print's `;`)
"""

import argparse
import operator
import os
import random
from functools import partial

from fairseq_feedback_cli.command_line import ArgumentParser, check_at_least, command, fail
from fairseq_feedback_cli.machine import check_within, in_memory
from fairseq_feedback_cli.outputs import atomic_folder, check_destination
from fairseq_feedback_cli.toy.scoring import NO_LOSS

SPLITS = ("train", "valid", "test")
DEFAULT_SIZES = {"train": 10000, "valid": 1000, "test": 1000}

# --- copy, reverse, counting ------------------------------------------------------

SEP = "="  # ends the question; the answer follows
END = "."  # label after the last answer token: the model must also know when to stop
DIGITS = tuple("0123456789")


def _teacher_forced(question, answer):
    tokens = question + [SEP] + answer
    labels = [NO_LOSS] * len(question) + answer + [END]
    return tokens, labels


def _digits_episode(rng, split, reverse, train_length=40, test_length=400):
    # the paper tests length generalisation: valid and test use the long length
    n = train_length if split == "train" else test_length
    question = [rng.choice(DIGITS) for _ in range(n)]
    return _teacher_forced(question, question[::-1] if reverse else question)


def _counting_episode(rng, split, max_length=50):
    n = rng.randint(1, max_length)
    return _teacher_forced(["A"] * n, ["B"] * n)


# --- random walk (appendix 7.1) ---------------------------------------------------

RESET, FORWARD, LEFT, RIGHT = "reset", "F", "L", "R"
_HEADINGS = ((-1, 0), (0, 1), (1, 0), (0, -1))  # (drow, dcol) for N E S W: a right turn is +1


def _cell(row, col, grid_size):
    return f"c{row * grid_size + col}"


def _walk_episode(rng, split, grid_size=8, episode_length=100):
    # fixed start: the middle cell, facing north
    row = col = grid_size // 2
    heading = 0
    tokens, labels = [RESET], [_cell(row, col, grid_size)]
    for _ in range(episode_length):
        action = rng.choice((FORWARD, LEFT, RIGHT))
        if action == LEFT:
            heading = (heading - 1) % 4
        elif action == RIGHT:
            heading = (heading + 1) % 4
        else:
            r, c = row + _HEADINGS[heading][0], col + _HEADINGS[heading][1]
            if 0 <= r < grid_size and 0 <= c < grid_size:  # a step off the grid is ignored
                row, col = r, c
        tokens.append(action)
        labels.append(_cell(row, col, grid_size))
    return tokens, labels


# --- algorithmic (appendix 7.4) ---------------------------------------------------
# Conventions of the official generator (facebookresearch/transformer-sequential,
# data/gen_data_algo_seq.py): names x y z p r, statement kinds drawn uniformly and
# redrawn until legal, every statement ends with its own `;`, a conditional compares
# with another variable or a constant (even odds) and nests one statement that is
# neither print nor if, and the printed value is labelled at the print's `;`. A
# nested statement under a false condition is not executed but must still be legal,
# so an initialisation there leaves the variable uninitialised (the paper's Table 7
# shows `if z < 5 : y = 7 ;` and later `y = 7 ;`).

VARIABLES = ("x", "y", "z", "p", "r")
LOW, HIGH = 1, 10
END_PROGRAM = "END"
COMPARE = {"<": operator.lt, ">": operator.gt, "==": operator.eq}
_KINDS = ("=", "++", "--", "if", "print")


def _try_statement(rng, kind, state, names, comparisons, nested):
    """Apply one statement of `kind` to `state`; (tokens, labels), or None if illegal here."""
    if kind == "=":
        fresh = [v for v in names if v not in state]
        if not fresh:
            return None
        var = rng.choice(fresh)
        state[var] = rng.randint(LOW, HIGH)
        return [var, "=", str(state[var]), ";"], [NO_LOSS] * 4
    known = list(state)
    if not known:
        return None
    if kind in ("++", "--"):
        var = rng.choice(known)
        value = state[var] + (1 if kind == "++" else -1)
        if not LOW <= value <= HIGH:
            return None
        state[var] = value
        return [var, kind, ";"], [NO_LOSS] * 3
    if nested:
        return None
    if kind == "print":
        var = rng.choice(known)
        return ["print", var, ";"], [NO_LOSS, NO_LOSS, str(state[var])]
    if rng.random() < 0.5:
        if len(known) < 2:
            return None
        var, other = rng.sample(known, 2)
        bound, rhs = state[other], other
    else:
        var = rng.choice(known)
        bound = rng.randint(LOW, HIGH)
        rhs = str(bound)
    op = rng.choice(comparisons)
    holds = COMPARE[op](state[var], bound)
    body, body_labels = _statement(rng, state if holds else dict(state), names, comparisons, True)
    return ["if", var, op, rhs, ":"] + body, [NO_LOSS] * 5 + body_labels


def _statement(rng, state, names, comparisons, nested=False):
    while True:
        made = _try_statement(rng, rng.choice(_KINDS), state, names, comparisons, nested)
        if made is not None:
            return made


def _program_episode(rng, split, variables=3, statements=100, equality=False):
    # the official generator only emits < and >; the paper's prose also shows ==
    comparisons = ("<", ">", "==") if equality else ("<", ">")
    state, tokens, labels = {}, [], []
    for _ in range(statements):
        t, l = _statement(rng, state, VARIABLES[:variables], comparisons)
        tokens += t
        labels += l
    return tokens + [END_PROGRAM], labels + [NO_LOSS]


# --- generation ----------------------------------------------------------------

EPISODES = {
    "copy": partial(_digits_episode, reverse=False),
    "reverse": partial(_digits_episode, reverse=True),
    "counting": _counting_episode,
    "random_walk": _walk_episode,
    "algorithmic": _program_episode,
}


def episodes(task, split, count, seed, **options):
    """Yield `count` (input_tokens, label_tokens) pairs of one split."""
    # one generator per split, so a split does not change when another one's size does
    rng = random.Random(f"{seed}/{task}/{split}")
    for _ in range(count):
        yield EPISODES[task](rng, split, **options)


def write_task(out, task, seed, sizes, force=False, **options):
    """Write out/task/{split}.{input,labels}; the folder appears complete or not at all."""
    final = os.path.join(out, task)
    if os.path.exists(final) and not force:
        raise FileExistsError(f"{final} exists (pass --force to replace it)")
    with atomic_folder(final) as tmp:
        for split in SPLITS:
            with open(tmp / f"{split}.input", "w") as fin, open(tmp / f"{split}.labels", "w") as flab:
                for tokens, labels in episodes(task, split, sizes[split], seed, **options):
                    fin.write(" ".join(tokens) + "\n")
                    flab.write(" ".join(labels) + "\n")
    return final


# --- command line -------------------------------------------------------------------


# counts, at least 1 each (those of the chosen task)
COUNTS = ("train", "valid", "test", "train_length", "test_length", "max_length", "grid_size", "episode_length",
          "statements")


# the tokens an episode takes for each unit of the options that set its length; a token takes up to 75 bytes as
# the episode is made (tracemalloc, episodes of 10**6 tokens: 28 for copy, 75 for the random walk)
TOKENS_EACH = {"train_length": 2, "test_length": 2, "max_length": 2, "episode_length": 1, "statements": 6}
BYTES_PER_TOKEN = 75


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, help="the task folder is written under it")
    common.add_argument("--seed", type=int, default=1)
    for split in SPLITS:
        common.add_argument(f"--{split}", type=int, default=DEFAULT_SIZES[split],
                            help=f"number of {split} episodes (default {DEFAULT_SIZES[split]})")
    common.add_argument("--force", action="store_true", help="replace an existing task folder")

    parser = ArgumentParser(prog="toy_tasks", description=__doc__.split("\n\n")[0])
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    for name in ("copy", "reverse"):
        p = tasks.add_parser(name, parents=[common], help=f"{name} a row of digits")
        p.add_argument("--train-length", type=int, default=40)
        p.add_argument("--test-length", type=int, default=400, help="valid and test length")
    p = tasks.add_parser("counting", parents=[common], help="n A's, then n B's")
    p.add_argument("--max-length", type=int, default=50, help="n is uniform in 1..max")
    p = tasks.add_parser("random_walk", parents=[common], help="track a walker on a grid")
    p.add_argument("--grid-size", type=int, default=8)
    p.add_argument("--episode-length", type=int, default=100)
    p = tasks.add_parser("algorithmic", parents=[common], help="print values of a toy program")
    p.add_argument("--variables", type=int, default=3, choices=range(1, len(VARIABLES) + 1))
    p.add_argument("--statements", type=int, default=100)
    p.add_argument("--equality", action="store_true", help="also emit `==` conditionals")
    return parser


@command
def main(argv=None):
    parsed = build_parser().parse_args(argv)
    check_at_least(parsed, **dict.fromkeys(COUNTS, 1))
    check_within(parsed, **{name: in_memory(BYTES_PER_TOKEN * tokens, "the length of an episode that fits")
                            for name, tokens in TOKENS_EACH.items()})
    check_destination(parsed.out, "--out", folder=True)
    args = vars(parsed)
    task, out, seed, force = args.pop("task"), args.pop("out"), args.pop("seed"), args.pop("force")
    sizes = {split: args.pop(split) for split in SPLITS}
    try:
        path = write_task(out, task, seed, sizes, force=force, **args)
    except FileExistsError as e:
        fail(str(e))
    print(f"wrote {path}: " + ", ".join(f"{sizes[s]} {s}" for s in SPLITS) + " episodes")


if __name__ == "__main__":
    main()
