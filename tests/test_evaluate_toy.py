"""feedback-evaluate-toy: Table 1's accuracy of a predictions file, or of a checkpoint streamed through its task."""

import json
import os
import random
import sys

import pytest
import torch
from helpers import TOY_SIZES, error_of, run_module

from fairseq_feedback_cli.toy import evaluate as evaluate_toy, predictions
from fairseq_feedback_cli.data_prep import toy_tasks as tt
from fairseq_feedback_cli.toy.scoring import METRICS, score


def read(path):
    with open(path) as f:
        return [line.split() for line in f]


def write(path, lines):
    with open(path, "w") as f:
        f.writelines(" ".join(line) + "\n" for line in lines)


def main_error(*argv):
    return error_of(evaluate_toy.main, [str(a) for a in argv])


# --- scoring a predictions file -------------------------------------------------------------


@pytest.mark.parametrize("task", ["random_walk", "algorithmic", "copy"])
def test_a_perfect_and_a_wrong_predictions_file(tmp_path, task, capsys):
    raw = tt.write_task(str(tmp_path / "raw"), task, 3, {"train": 1, "valid": 1, "test": 6},
                        **({"train_length": 5, "test_length": 7} if task == "copy" else {}))
    labels = read(os.path.join(raw, "test.labels"))
    perfect = tmp_path / "perfect.txt"
    write(perfect, labels)
    result = evaluate_toy.main(["--task", task, "--predictions", str(perfect), "--raw", os.path.join(raw, "test.labels")])
    token_metric, line_metric = METRICS[task]
    assert (result[token_metric], result[line_metric]) == (1.0, 1.0)
    assert result["lines"] == 6 and result["scored"] == sum(l != "_" for line in labels for l in line)
    assert f"{token_metric} 100.00  {line_metric} 100.00" in capsys.readouterr().out

    # wrong at 3 labelled positions of line 0 and 1 of line 3 (and at every unlabelled one: not counted)
    wrong = [["?" if l == "_" else l for l in line] for line in labels]
    labelled = {n: [i for i, l in enumerate(line) if l != "_"] for n, line in enumerate(labels)}
    for n, k in ((0, 3), (3, 1)):
        for i in random.Random(n).sample(labelled[n], k):
            wrong[n][i] = "?"
    write(tmp_path / "wrong.txt", wrong)
    result = evaluate_toy.main(["--task", task, "--predictions", str(tmp_path / "wrong.txt"), "--raw",
                                os.path.join(raw, "test.labels"), "--json"])
    total = sum(map(len, labelled.values()))
    assert result[token_metric] == pytest.approx((total - 4) / total)
    assert result[line_metric] == pytest.approx(4 / 6)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])[token_metric] == result[token_metric]


def test_the_console_script_scores_and_returns_nothing_for_its_exit_status(tmp_path, monkeypatch, capsys):
    """feedback-evaluate-toy calls cli(): a console script exits with what its function returns, and
    main's result, a dict, would be printed to stderr with exit status 1."""
    raw = tt.write_task(str(tmp_path / "raw"), "random_walk", 1, {"train": 1, "valid": 1, "test": 3},
                        episode_length=5)
    labels = os.path.join(raw, "test.labels")
    monkeypatch.setattr(sys, "argv", ["feedback-evaluate-toy", "--task", "random_walk", "--predictions", labels,
                                      "--raw", labels])
    assert evaluate_toy.cli() is None
    token_metric, line_metric = METRICS["random_walk"]
    assert f"{token_metric} 100.00  {line_metric} 100.00" in capsys.readouterr().out


def test_bad_predictions_and_arguments_are_one_line(tmp_path):
    raw = tt.write_task(str(tmp_path / "raw"), "random_walk", 1, {"train": 1, "valid": 1, "test": 3},
                        episode_length=5)
    labels = os.path.join(raw, "test.labels")
    write(tmp_path / "short.txt", read(labels)[:2])
    assert "3 label lines but 2 predicted" in main_error("--task", "random_walk", "--predictions",
                                                         tmp_path / "short.txt", "--raw", labels)
    assert "predictions file" in main_error("--task", "random_walk", "--predictions", tmp_path / "none.txt",
                                            "--raw", labels)
    assert "invalid choice" in main_error("--task", "walk", "--predictions", labels, "--raw", labels)
    assert "--raw" in main_error("--task", "random_walk", "--predictions", labels)
    assert "--path" in main_error("--task", "random_walk", "--data", tmp_path)
    assert "checkpoint" in main_error("--task", "random_walk", "--data", tmp_path, "--path", tmp_path / "x.pt")
    write(tmp_path / "x.pt", [["not", "a", "checkpoint"]])
    assert "x.pt is a text file (it begins 'not a checkpoint'), not a checkpoint" in main_error(
        "--task", "random_walk", "--data", tmp_path, "--path", tmp_path / "x.pt")


def test_predictions_get_the_umasks_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        predictions.write_lines(str(tmp_path / "pred.txt"), [["c1", "c2"]])
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "pred.txt").st_mode & 0o777 == 0o644  # readable by others, as any file they write


# --- a trained checkpoint, end to end --------------------------------------------------------


def test_evaluating_a_checkpoint_writes_aligned_predictions_and_scores_them(toy_model, tmp_path):
    raw, data, ckpt = toy_model
    out = tmp_path / "pred.txt"
    proc = run_module("fairseq_feedback_cli.toy.evaluate", "--task", "random_walk", "--data", data, "--path", ckpt,
                      "--raw", f"{raw}/test.labels", "--output", out, "--json")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    labels, predicted = read(f"{raw}/test.labels"), read(out)
    assert [len(line) for line in predicted] == [len(line) for line in labels]
    assert len(predicted) == TOY_SIZES["test"]
    assert result["updates"] == 3 and result["lines"] == TOY_SIZES["test"]
    assert {k: result[k] for k in ("acc", "episode_acc")} == score("random_walk", labels, predicted)
    assert [f for f in os.listdir(tmp_path) if f != "pred.txt"] == []  # no temporary file left


def test_predictions_are_the_argmax_of_the_model_over_the_whole_stream(toy_model, tmp_path):
    """Read in blocks with the memory carried, one stream gives the argmax of a
    single pass over the whole split: the predictions land on the right tokens."""
    raw, data, ckpt = toy_model
    result = predictions.evaluate("random_walk", str(data), str(ckpt), split="valid", batch_size=1,
                                   output=str(tmp_path / "valid.txt"))
    model, task, _, _ = predictions.load(str(ckpt), str(data))
    model.eval()
    task.load_dataset("valid")
    dataset = task.dataset("valid")
    tokens = torch.cat([dataset.tokens[i] for i in range(len(dataset))])
    with torch.no_grad():
        best = model(tokens.unsqueeze(0))[0][0].argmax(-1).tolist()
    symbols, expected, start = task.target_dictionary.symbols, [], 0
    for size in dataset.sizes.tolist():
        expected.append([symbols[i] for i in best[start: start + size - 1]])
        start += size
    assert read(tmp_path / "valid.txt") == expected
    # scored against the binarized labels when no raw file is given: the same as against the raw file
    assert {k: result[k] for k in ("acc", "episode_acc")} == score("random_walk", read(f"{raw}/valid.labels"),
                                                                   expected)


def test_a_batch_larger_than_the_split_evaluates_each_episode_in_a_stream_of_its_own(toy_model, tmp_path):
    """The default batch (128 streams) on a split of a few episodes: one stream each, not a refusal of
    more streams than the split has tokens."""
    raw, data, ckpt = toy_model
    episodes = predictions.evaluate("random_walk", str(data), str(ckpt), split="valid", batch_size=TOY_SIZES["valid"],
                                    output=str(tmp_path / "episodes.txt"))
    more = predictions.evaluate("random_walk", str(data), str(ckpt), split="valid", batch_size=10**6,
                                output=str(tmp_path / "more.txt"))
    assert read(tmp_path / "more.txt") == read(tmp_path / "episodes.txt")
    assert {k: more[k] for k in ("acc", "episode_acc")} == {k: episodes[k] for k in ("acc", "episode_acc")}


def test_labels_of_another_split_of_the_same_shape_are_refused_not_scored(toy_model, tmp_path):
    """Episodes of one length: the valid split's labels (or the test split's in
    another order) line up with the test predictions token for token, and
    would be scored as if they were the test split's answers."""
    raw, data, ckpt = toy_model
    labels = read(f"{raw}/test.labels")
    assert len({len(line) for line in labels}) == 1
    write(tmp_path / "shuffled.labels", labels[::-1])
    assert main_error("--task", "random_walk", "--data", data, "--path", ckpt, "--raw", tmp_path / "shuffled.labels",
                      "--output", tmp_path / "p.txt") == (
        f"error: {tmp_path / 'shuffled.labels'} does not match the test split of {data} (line 1 differs): pass the "
        "test split's labels file (the generator's test.labels)")
    assert not os.path.exists(tmp_path / "p.txt")


def test_a_checkpoint_with_other_data_is_one_line(toy_model, tmp_path):
    raw, data, ckpt = toy_model
    assert "does not match the test split" in main_error(
        "--task", "random_walk", "--data", data, "--path", ckpt, "--raw", f"{raw}/valid.labels",
        "--output", tmp_path / "p.txt")
    assert not os.path.exists(tmp_path / "p.txt")
    assert "split 'nope' not found" in main_error("--task", "random_walk", "--data", data, "--path", ckpt,
                                                  "--split", "nope")
