"""fairseq_feedback_cli.evaluate_toy (Table 1's accuracy from a checkpoint) and the demo's pieces."""

import json
import os
import random

import pytest
import torch

from cli import run, run_module
from data_prep import toy_tasks as tt
from fairseq_feedback_cli.outputs import atomic_folder
from fairseq_feedback_cli import demo, evaluate_toy
from fairseq_feedback_cli.command_line import fail

SIZES = {"train": 24, "valid": 4, "test": 7}
MODEL = ["--arch", "feedback_lm_toy", "--decoder-layers", "2", "--decoder-embed-dim", "16",
         "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--memory-span", "16", "--dropout", "0"]


def read(path):
    with open(path) as f:
        return [line.split() for line in f]


def write(path, lines):
    with open(path, "w") as f:
        f.writelines(" ".join(line) + "\n" for line in lines)


def main_error(*argv):
    with pytest.raises(SystemExit) as e:
        evaluate_toy.main([str(a) for a in argv])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


# --- scoring a predictions file -------------------------------------------------------------


@pytest.mark.parametrize("task", ["random_walk", "algorithmic", "copy"])
def test_a_perfect_and_a_wrong_predictions_file(tmp_path, task, capsys):
    raw = tt.write_task(str(tmp_path / "raw"), task, 3, {"train": 1, "valid": 1, "test": 6},
                        **({"train_length": 5, "test_length": 7} if task == "copy" else {}))
    labels = read(os.path.join(raw, "test.labels"))
    perfect = tmp_path / "perfect.txt"
    write(perfect, labels)
    result = evaluate_toy.main(["--task", task, "--predictions", str(perfect), "--raw", os.path.join(raw, "test.labels")])
    token_metric, line_metric = tt.METRICS[task]
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
    assert "not a readable fairseq checkpoint" in main_error("--task", "random_walk", "--data", tmp_path,
                                                             "--path", tmp_path / "x.pt")


def test_predictions_get_the_umasks_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        evaluate_toy.write_lines(str(tmp_path / "pred.txt"), [["c1", "c2"]])
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "pred.txt").st_mode & 0o777 == 0o644  # readable by others, as any file they write


# --- a trained checkpoint, end to end --------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random walk, binarized, and a tiny feedback model trained for 3 updates."""
    root = tmp_path_factory.mktemp("toy")
    raw = tt.write_task(str(root / "raw"), "random_walk", 1, SIZES, grid_size=3, episode_length=12)
    data = root / "bin"
    for kind, dest in (("input", data), ("labels", data / "labels")):
        run("preprocess", "--only-source", *[a for s in tt.SPLITS for a in (f"--{s}pref", f"{raw}/{s}.{kind}")],
            "--destdir", dest)
    run("train", data, "--task", "feedback_language_modeling", "--labels", "labels", *MODEL,
        "--tokens-per-sample", 16, "--batch-size", 3, "--optimizer", "adam", "--lr", "1e-3", "--max-update", 3,
        "--save-dir", root / "ckpt", "--disable-validation", "--num-workers", 0, "--no-epoch-checkpoints")
    return raw, data, root / "ckpt" / "checkpoint_last.pt"


def test_evaluating_a_checkpoint_writes_aligned_predictions_and_scores_them(trained, tmp_path):
    raw, data, ckpt = trained
    out = tmp_path / "pred.txt"
    proc = run_module("fairseq_feedback_cli.evaluate_toy", "--task", "random_walk", "--data", data, "--path", ckpt,
                      "--raw", f"{raw}/test.labels", "--output", out, "--json")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    labels, predicted = read(f"{raw}/test.labels"), read(out)
    assert [len(line) for line in predicted] == [len(line) for line in labels]
    assert len(predicted) == SIZES["test"]
    assert result["updates"] == 3 and result["lines"] == SIZES["test"]
    assert {k: result[k] for k in ("acc", "episode_acc")} == tt.score("random_walk", labels, predicted)
    assert [f for f in os.listdir(tmp_path) if f != "pred.txt"] == []  # no temporary file left


def test_predictions_are_the_argmax_of_the_model_over_the_whole_stream(trained, tmp_path):
    """Read in blocks with the memory carried, one stream gives the argmax of a
    single pass over the whole split: the predictions land on the right tokens."""
    raw, data, ckpt = trained
    result = evaluate_toy.evaluate("random_walk", str(data), str(ckpt), split="valid", batch_size=1,
                                   output=str(tmp_path / "valid.txt"))
    model, task, _, _ = evaluate_toy.load(str(ckpt), str(data))
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
    assert {k: result[k] for k in ("acc", "episode_acc")} == tt.score("random_walk", read(f"{raw}/valid.labels"),
                                                                      expected)


def test_a_checkpoint_with_other_data_is_one_line(trained, tmp_path):
    raw, data, ckpt = trained
    assert "does not match the test split" in main_error(
        "--task", "random_walk", "--data", data, "--path", ckpt, "--raw", f"{raw}/valid.labels",
        "--output", tmp_path / "p.txt")
    assert not os.path.exists(tmp_path / "p.txt")
    assert "split 'nope' not found" in main_error("--task", "random_walk", "--data", data, "--path", ckpt,
                                                  "--split", "nope")


# --- the demo's pieces -----------------------------------------------------------------------


def fake_results():
    def r(updates, acc, episode):
        return {"updates": updates, "acc": acc, "episode_acc": episode}

    return {"feedback": [r(100, 0.5, 0.0), r(200, 0.9, 0.25)], "transformer": [r(100, 0.3, 0.0), r(200, 0.35, 0.0)]}


def test_demo_table_and_plot(tmp_path):
    text = demo.table(fake_results(), "random_walk")
    lines = text.splitlines()
    assert lines[0].split("|")[1:-1] == [c.rjust(len(c)) for c in lines[0].split("|")[1:-1]]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "updates", "feedback acc", "feedback episode_acc", "transformer acc", "transformer episode_acc"]
    assert [c.strip() for c in lines[3].strip("|").split("|")] == ["200", "90.0", "25.0", "35.0", "0.0"]
    demo.plot(fake_results(), "random_walk", str(tmp_path / "a.png"), title="t")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def demo_folder(out, results):
    """Builds a demo's folder as demo.run does, holding only results.md; returns where it was built."""
    with atomic_folder(out, check=demo.check_replaceable) as new:
        (new / demo.MARKER).write_text("")
        (new / "results.md").write_text(results)
    return new


def test_demo_replaces_only_its_own_folder(tmp_path):
    out = tmp_path / "demo"
    for attempt in range(2):  # a fresh folder, then a previous demo's
        new = demo_folder(out, str(attempt))
        assert (out / "results.md").read_text() == str(attempt) and not new.exists()
    assert sorted(os.listdir(tmp_path)) == ["demo"]  # the previous one is gone, nothing left over
    other = tmp_path / "mine"
    other.mkdir()
    (other / "thesis.tex").write_text("")
    with pytest.raises(SystemExit, match="not a folder this demo wrote"):
        demo_folder(other, "new")
    assert (other / "thesis.tex").exists()


def test_demo_failure_leaves_the_previous_results(tmp_path, monkeypatch):
    out = tmp_path / "demo"
    out.mkdir()
    (out / demo.MARKER).write_text("")
    (out / "results.md").write_text("old")

    def broken(*args, **kwargs):
        fail("training failed")

    monkeypatch.setattr(demo, "train_all", broken)
    monkeypatch.setattr(demo, "make_data", lambda folder, config, env: ("raw", "bin"))
    with pytest.raises(SystemExit, match="training failed"):
        demo.run(str(out), demo.TINY)
    assert sorted(os.listdir(tmp_path)) == ["demo"] and (out / "results.md").read_text() == "old"


def test_demo_checkpoints_and_commands(trained, tmp_path):
    _, data, ckpt = trained
    found, final = demo.checkpoints(str(ckpt.parent), 3)
    assert found == {3: str(ckpt)} and final == 3
    cmd = demo.train_command(str(data), str(tmp_path), demo.CONFIG, demo.MODELS["transformer"])
    assert "--no-feedback" in cmd and cmd[cmd.index("--max-update") + 1] == str(demo.CONFIG["updates"])
