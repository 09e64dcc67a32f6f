import os

import pytest
from toy_oracles import check_answer_line, execute_program, replay_walk

from fairseq_feedback_cli.data_prep import toy_tasks as tt
from fairseq_feedback_cli.toy import scoring

TASKS = ("copy", "reverse", "counting", "random_walk", "algorithmic")
SMALL = ["--train", "6", "--valid", "2", "--test", "2"]


def generate(tmp_path, task, seed=1, *extra):
    out = tmp_path / f"seed{seed}_{'_'.join(extra)}"
    tt.main([task, "--out", str(out), "--seed", str(seed), *SMALL, *extra])
    return out / task


def read(folder, split):
    """(input lines, label lines) of a split, as token lists."""
    lines = {}
    for kind in ("input", "labels"):
        with open(folder / f"{split}.{kind}") as f:
            lines[kind] = [line.split() for line in f]
    return lines["input"], lines["labels"]


def all_episodes(folder):
    for split in tt.SPLITS:
        for tokens, labels in zip(*read(folder, split)):
            yield split, tokens, labels


def file_bytes(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


# --- shared properties ----------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_and_seed_dependent(tmp_path, task):
    first = file_bytes(generate(tmp_path / "a", task, 1))
    assert first == file_bytes(generate(tmp_path / "b", task, 1))
    other = file_bytes(generate(tmp_path / "c", task, 2))
    assert all(first[name] != other[name] for name in first)


@pytest.mark.parametrize("task", TASKS)
def test_files_aligned_and_complete(tmp_path, task):
    folder = generate(tmp_path, task)
    expected = {f"{split}.{kind}" for split in tt.SPLITS for kind in ("input", "labels")}
    assert set(os.listdir(folder)) == expected
    assert os.listdir(folder.parent) == [task]  # no temporary folder left behind
    for split, count in zip(tt.SPLITS, (6, 2, 2)):
        inputs, labels = read(folder, split)
        assert len(inputs) == len(labels) == count
        assert [len(t) for t in inputs] == [len(l) for l in labels]


def test_split_does_not_depend_on_other_split_sizes():
    test_a = list(tt.episodes("algorithmic", "test", 3, seed=5))
    assert test_a == list(tt.episodes("algorithmic", "test", 3, seed=5))
    assert test_a != list(tt.episodes("algorithmic", "valid", 3, seed=5))


# --- copy, reverse, counting --------------------------------------------------------


@pytest.mark.parametrize("task", ("copy", "reverse"))
def test_copy_reverse(tmp_path, task):
    for split, tokens, labels in all_episodes(generate(tmp_path, task)):
        assert check_answer_line(task, tokens, labels)
        assert tokens.index(tt.SEP) == (40 if split == "train" else 400)
    folder = generate(tmp_path, task, 1, "--train-length", "3", "--test-length", "7")
    assert {len(t) for s, t, _ in all_episodes(folder) if s == "train"} == {2 * 3 + 1}
    assert {len(t) for s, t, _ in all_episodes(folder) if s != "train"} == {2 * 7 + 1}


def test_reverse_is_not_copy():
    tokens, labels = next(tt.episodes("reverse", "train", 1, seed=0))
    assert check_answer_line("reverse", tokens, labels)
    assert not check_answer_line("copy", tokens, labels)


@pytest.mark.parametrize("max_length", (50, 1000))
def test_counting(tmp_path, max_length):
    folder = generate(tmp_path, "counting", 1, "--max-length", str(max_length))
    for _, tokens, labels in all_episodes(folder):
        assert check_answer_line("counting", tokens, labels)
        assert 1 <= tokens.count("A") <= max_length


def test_answer_checker_rejects_wrong_lines():
    assert check_answer_line("copy", "3 1 = 3 1".split(), "_ _ 3 1 .".split())
    assert not check_answer_line("copy", "3 1 = 3 2".split(), "_ _ 3 2 .".split())
    assert not check_answer_line("copy", "3 1 = 3 1".split(), "_ _ 3 1 _".split())
    assert check_answer_line("counting", "A A = B B".split(), "_ _ B B .".split())
    assert not check_answer_line("counting", "A A = B".split(), "_ _ B .".split())


# --- random walk --------------------------------------------------------------------


def test_random_walk(tmp_path):
    for _, tokens, labels in all_episodes(generate(tmp_path, "random_walk")):
        assert len(tokens) == 101 and tokens[0] == tt.RESET
        assert set(tokens[1:]) <= {tt.FORWARD, tt.LEFT, tt.RIGHT}
        assert labels == replay_walk(tokens)
        assert {int(cell[1:]) for cell in labels} <= set(range(64))


def test_replay_walk_by_hand():
    # start c36 = row 4, col 4, facing north; the top wall stops the walker at row 0
    walk = ["reset"] + ["F"] * 6 + ["R", "F", "R", "F", "L", "L", "F", "reset"]
    assert replay_walk(walk) == ["c36", "c28", "c20", "c12", "c4", "c4", "c4",
                                    "c4", "c5", "c5", "c13", "c13", "c13", "c5", "c36"]
    with pytest.raises(ValueError):
        replay_walk(["reset", "jump"])


# --- algorithmic --------------------------------------------------------------------


@pytest.mark.parametrize("variables", (3, 5))
def test_algorithmic(tmp_path, variables):
    folder = generate(tmp_path, "algorithmic", 1, "--variables", str(variables))
    names = set(tt.VARIABLES[:variables])
    for _, tokens, labels in all_episodes(folder):
        assert tokens[-1] == "END" and tokens.count(";") == 100
        # the executor raises on use before initialisation, re-initialisation and
        # values outside 1..10, so this also checks those constraints
        printed = execute_program(tokens)
        assert [int(l) for l in labels if l != "_"] == printed
        # each value sits on the `;` of its print statement
        assert [i for i, l in enumerate(labels) if l != "_"] == [
            i for i, t in enumerate(tokens) if t == ";" and tokens[i - 2] == "print"]
        used = {t for t in tokens if t.isalpha() and len(t) == 1}
        assert used <= names
        assert {int(t) for t in tokens if t.isdigit()} <= set(range(1, 11))
        # nested statements are never print or if
        assert all(tokens[i + 1] not in ("print", "if") for i, t in enumerate(tokens) if t == ":")


def test_algorithmic_equality_flag():
    ops = {t for tokens, _ in tt.episodes("algorithmic", "train", 20, seed=0) for t in tokens}
    assert "==" not in ops and {"<", ">"} <= ops
    ops = {t for tokens, _ in tt.episodes("algorithmic", "train", 20, seed=0, equality=True)
           for t in tokens}
    assert "==" in ops
    for tokens, labels in tt.episodes("algorithmic", "train", 20, seed=0, equality=True):
        assert [int(l) for l in labels if l != "_"] == execute_program(tokens)


def test_execute_program_by_hand():
    program = "x = 9 ; y = 2 ; x ++ ; if x > y : y -- ; if y == 5 : z = 3 ; print y ; print x ; END"
    assert execute_program(program.split()) == [1, 10]
    for bad in ("print x ; END",                     # use before initialisation
                "x = 1 ; x = 2 ; END",               # initialised twice
                "x = 10 ; x ++ ; END",               # above 10
                "x = 1 ; if x > 5 : x -- ; END",     # skipped, but would go below 1
                "x = 1 ; if x < 5 : print x ; END",  # nested print
                "x = 1 ; print x",                   # no END
                "x = 1 ; print x END"):              # no ';'
        with pytest.raises(ValueError):
            execute_program(bad.split())


# --- scoring ------------------------------------------------------------------------


def test_score_perfect_on_generated_labels(tmp_path):
    for task in TASKS:
        _, labels = read(generate(tmp_path, task), "valid")
        key_token, key_line = scoring.METRICS[task]
        assert scoring.score(task, labels, labels) == {key_token: 1.0, key_line: 1.0}


def test_score_hand_made():
    labels = ["_ _ 3 1 .", "_ _ 7 7 ."]
    # line 1 all right (a wrong guess under `_` is not counted), line 2 one wrong of three
    predicted = ["9 9 3 1 .", "_ _ 7 2 ."]
    assert scoring.score("copy", labels, predicted) == {"char_acc": 5 / 6, "seq_acc": 0.5}
    labels = ["_ _ 4 _ 5", "_ _ _", "2 _ _"]  # the middle line has nothing to score
    predicted = [["x", "x", "4", "x", "6"], "_ _ _", "3 _ _"]
    assert scoring.score("algorithmic", labels, predicted) == {"acc": 1 / 3, "episode_acc": 0.0}
    assert scoring.score("random_walk", ["c1 c2", "c3 c4"], ["c1 c2", "c3 c5"]) == {
        "acc": 0.75, "episode_acc": 0.5}


def test_score_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        scoring.score("copy", ["_ 1 ."], ["_ 1 . ."])
    with pytest.raises(ValueError):
        scoring.score("copy", ["_ 1 .", "_ 2 ."], ["_ 1 ."])
    with pytest.raises(ValueError):
        scoring.score("nope", ["_ 1 ."], ["_ 1 ."])


# --- command line and atomic output -------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["copy", "--out", "X", "--train", "0"],
    ["copy", "--out", "X", "--train", "many"],
    ["algorithmic", "--out", "X", "--variables", "7"],
    ["copy", "--out", "X", "--variables", "3"],
    ["sort", "--out", "X"],
    ["copy"],
    [],
])
def test_bad_arguments_give_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as err:
        tt.main(argv)
    message = str(err.value.code)
    assert "error" in message and "\n" not in message
    assert capsys.readouterr().err == ""  # no usage dump


def test_existing_folder_needs_force(tmp_path):
    folder = generate(tmp_path, "copy", 1)
    before = file_bytes(folder)
    with pytest.raises(SystemExit, match="exists"):
        tt.main(["copy", "--out", str(folder.parent), "--seed", "2", *SMALL])
    assert file_bytes(folder) == before
    tt.main(["copy", "--out", str(folder.parent), "--seed", "2", *SMALL, "--force"])
    assert file_bytes(folder) != before
    assert os.listdir(folder.parent) == ["copy"]


def test_failed_generation_leaves_nothing(tmp_path, monkeypatch):
    def broken(rng, split, **options):
        if split == "test":
            raise RuntimeError("disk on fire")
        return ["1"], ["_"]

    monkeypatch.setitem(tt.EPISODES, "copy", broken)
    with pytest.raises(RuntimeError):
        tt.write_task(str(tmp_path), "copy", 1, {"train": 2, "valid": 2, "test": 2})
    assert os.listdir(tmp_path) == []
