"""The toy tasks' answers worked out again, apart from the generator
(fairseq_feedback_cli/data_prep/toy_tasks.py), for tests/test_toy_tasks.py to hold its episodes to:
each oracle states its task's rule in another way than the generator does."""

from fairseq_feedback_cli.data_prep.toy_tasks import (COMPARE, DIGITS, END, END_PROGRAM, FORWARD, HIGH, LEFT, LOW,
                                                      RESET, RIGHT, SEP)
from fairseq_feedback_cli.toy.scoring import NO_LOSS


def check_answer_line(task, input_tokens, label_tokens):
    """True iff one copy / reverse / counting line is well formed and answered right: the question,
    SEP, the answer teacher-forced; no label on the question, then the answer and END."""
    if SEP not in input_tokens:
        return False
    question = input_tokens[: input_tokens.index(SEP)]
    if task == "counting":
        if set(question) != {"A"}:
            return False
        answer = ["B"] * len(question)
    elif task in ("copy", "reverse"):
        if not question or not all(t in DIGITS for t in question):
            return False
        answer = question if task == "copy" else question[::-1]
    else:
        raise ValueError(f"not a copy/reverse/counting task: {task}")
    return (input_tokens, label_tokens) == (question + [SEP] + answer, [NO_LOSS] * len(question) + answer + [END])


def replay_walk(input_tokens, grid_size=8):
    """The cell after each token of a walk (a reset puts the agent back at the start).

    Written with complex numbers on purpose, unlike the generator, so that the
    tests check one formulation against the other.
    """
    start = complex(grid_size // 2, grid_size // 2)  # col + row*1j, rows grow southwards
    pos, facing = start, -1j
    cells = []
    for token in input_tokens:
        if token == RESET:
            pos, facing = start, -1j
        elif token == LEFT:
            facing *= -1j
        elif token == RIGHT:
            facing *= 1j
        elif token == FORWARD:
            ahead = pos + facing
            if 0 <= ahead.real < grid_size and 0 <= ahead.imag < grid_size:
                pos = ahead
        else:
            raise ValueError(f"not a walk token: {token!r}")
        cells.append(f"c{int(pos.imag) * grid_size + int(pos.real)}")
    return cells


def execute_program(input_tokens):
    """The values printed by one program; ValueError if it breaks the task's rules
    (use before initialisation, a second initialisation, a value outside 1..10,
    a nested if or print, bad syntax)."""
    if not input_tokens or input_tokens[-1] != END_PROGRAM:
        raise ValueError("a program ends with END")
    statements, current = [], []
    for token in input_tokens[:-1]:
        current.append(token)
        if token == ";":
            statements.append(current)
            current = []
    if current:
        raise ValueError(f"statement without ';': {current}")
    state, printed = {}, []
    for stmt in statements:
        if stmt[0] == "if":
            if len(stmt) < 6 or stmt[4] != ":" or stmt[2] not in COMPARE:
                raise ValueError(f"bad conditional: {stmt}")
            rhs = int(stmt[3]) if stmt[3].isdigit() else _read(state, stmt[3])
            holds = COMPARE[stmt[2]](_read(state, stmt[1]), rhs)
            if stmt[5] in ("if", "print"):
                raise ValueError(f"nested {stmt[5]}: {stmt}")
            # a skipped statement must still be legal, so run it on a scratch copy
            _execute_simple(stmt[5:], state if holds else dict(state), printed)
        else:
            _execute_simple(stmt, state, printed)
    return printed


def _read(state, var):
    if var not in state:
        raise ValueError(f"{var} used before initialisation")
    return state[var]


def _execute_simple(stmt, state, printed):
    if len(stmt) == 3 and stmt[0] == "print":
        printed.append(_read(state, stmt[1]))
        return
    if len(stmt) == 4 and stmt[1] == "=":
        if stmt[0] in state:
            raise ValueError(f"{stmt[0]} initialised twice")
        state[stmt[0]] = int(stmt[2])
    elif len(stmt) == 3 and stmt[1] in ("++", "--"):
        state[stmt[0]] = _read(state, stmt[0]) + (1 if stmt[1] == "++" else -1)
    else:
        raise ValueError(f"bad statement: {stmt}")
    if not LOW <= state[stmt[0]] <= HIGH:
        raise ValueError(f"{stmt[0]} = {state[stmt[0]]} is outside {LOW}..{HIGH}")
