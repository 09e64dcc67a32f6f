"""fairseq_feedback_cli.curves: learning curves and markdown rows from toy evaluations and fairseq json logs."""

import json
import os

import matplotlib.pyplot as plt
from helpers import error_of

from fairseq_feedback_cli import curves, plots


def write_log(path, records):
    """A fairseq-train --log-format json --log-file: the config dump, then one JSON object a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["{'_name': None, 'common': {'log_format': 'json'}}", "FeedbackLanguageModel("]
    path.write_text("\n".join(lines + [json.dumps(r) for r in records]) + "\n")
    return path


def curves_error(*argv):
    return error_of(curves.main, [str(a) for a in argv])


def test_log_curves_add_up_the_clock_of_resumed_runs(tmp_path, capsys):
    feedback = write_log(tmp_path / "feedback" / "train.log", [
        {"epoch": 1, "loss": "9", "num_updates": "50", "wall": "900"},
        {"epoch": 1, "num_updates": "100", "wall": "1800"},
        {"epoch": 1, "valid_loss": "5.02", "valid_ppl": "32.5", "valid_num_updates": "100"},
        {"epoch": 2, "num_updates": "150", "wall": "450"},  # resumed: fairseq's clock starts again
        {"epoch": 2, "num_updates": "200", "wall": "900"},
        {"epoch": 2, "valid_loss": "4.02", "valid_ppl": "16.25", "valid_num_updates": "200"},
    ])
    transformer = write_log(tmp_path / "transformer" / "train.log", [
        {"epoch": 1, "num_updates": "200", "wall": "360"},
        {"epoch": 1, "valid_loss": "4.5", "valid_ppl": "22.6", "valid_num_updates": "200"},
    ])
    assert curves.log_points(str(feedback), "valid_ppl") == [(100, 0.5, 32.5), (200, 0.75, 16.25)]
    curves.main(["log", "--out", str(tmp_path / "curve.png"), str(feedback), str(transformer)])
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["| feedback | 200 | 16.25 | 0.75 |", "| transformer | 200 | 22.60 | 0.10 |"]
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_perplexity_is_drawn_on_a_log_axis_and_other_metrics_on_a_linear_one():
    """A perplexity falls by orders of magnitude early on; on a linear axis the late differences vanish."""
    runs = {"feedback": [(100, 0.1, 300.0), (200, 0.2, 21.0), (300, 0.3, 18.5)],
            "transformer": [(100, 0.1, 280.0), (200, 0.2, 23.0), (300, 0.3, 20.5)]}
    for metric, scale in (("valid_ppl", "log"), ("valid_loss", "linear"), ("valid_bleu", "linear")):
        fig = plots.validation_curves(runs, metric)
        assert [ax.get_yscale() for ax in fig.axes] == [scale, scale], metric  # against updates and hours
        plt.close(fig)


def evaluation(task, updates, acc, episode_acc, seconds):
    return {"acc": acc, "episode_acc": episode_acc, "task": task, "split": "test", "updates": updates,
            "train_seconds": seconds, "lines": 10, "scored": 100}


def test_toy_curves_one_png_and_one_row_per_model(tmp_path, capsys):
    root = tmp_path / "checkpoints" / "toy"
    for model, accuracies in (("feedback", (0.4, 0.9)), ("transformer", (0.3, 0.45))):
        folder = root / "random_walk" / model
        folder.mkdir(parents=True)
        for updates, acc in zip((1000, 2000), accuracies):
            # the file holds whatever the command printed before its JSON line, if anything
            (folder / f"test.{updates}.json").write_text(
                json.dumps(evaluation("random_walk", updates, acc, acc / 2, 1.8 * updates)) + "\n")
    folder = root / "algorithmic3" / "transformer8"
    folder.mkdir(parents=True)
    (folder / "test.1000.json").write_text("a warning\n" + json.dumps(evaluation("algorithmic", 1000, 0.5, 0, None)))
    curves.main(["toy", "--out", str(tmp_path / "results"), *map(str, sorted(root.glob("*/*")))])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows == ["| algorithmic3 | transformer8 | 1000 | 50.0 | 0.0 |  |",
                    "| random_walk | feedback | 2000 | 90.0 | 45.0 | 1.00 |",
                    "| random_walk | transformer | 2000 | 45.0 | 22.5 | 1.00 |"]
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["algorithmic3.png", "random_walk.png"]


def test_a_family_of_toy_tasks_is_one_figure_with_a_panel_per_task(tmp_path, capsys, monkeypatch):
    root = tmp_path / "checkpoints" / "toy"
    for task, kind in (("algorithmic1", "algorithmic"), ("algorithmic2", "algorithmic"), ("counting50", "counting")):
        for model in ("feedback", "transformer"):
            (root / task / model).mkdir(parents=True)
            result = evaluation(kind, 100, 0.5, 0.1, 60)
            if kind == "counting":
                result.update(char_acc=result.pop("acc"), seq_acc=result.pop("episode_acc"))
            (root / task / model / "test.100.json").write_text(json.dumps(result))
    figures = []
    monkeypatch.setattr(curves.plots, "save", lambda fig, path, dpi=100: figures.append((fig, os.path.basename(path))))
    curves.main(["toy", "--out", str(tmp_path / "r"), "--family", "tasks", *map(str, sorted(root.glob("*/*")))])
    assert len(capsys.readouterr().out.splitlines()) == 2 + 6  # the rows stay one per model
    [(fig, name)] = figures
    assert name == "tasks.png" and [ax.get_title() for ax in fig.axes] == ["algorithmic1", "algorithmic2", "counting50"]
    # each panel its task's metrics, and both models
    assert [[t.get_text() for t in ax.get_legend().get_texts()][:4] for ax in fig.axes] == \
        [["feedback", "transformer", "acc", "episode_acc"]] * 2 + [["feedback", "transformer", "char_acc", "seq_acc"]]
    assert fig._suptitle.get_text() == "tasks"
    plt.close(fig)


def test_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "holds no test.UPDATES.json evaluations" in curves_error("toy", "--out", tmp_path / "r", tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "test.10.json").write_text("Traceback (most recent call last):\n")
    assert "is not an evaluation's JSON" in curves_error("toy", "--out", tmp_path / "r", tmp_path / "broken")
    log = write_log(tmp_path / "m" / "train.log", [{"epoch": 1, "num_updates": "1", "wall": "1"}])
    assert "has no valid_ppl" in curves_error("log", "--out", tmp_path / "c.png", log)
    assert "cannot read" in curves_error("log", "--out", tmp_path / "c.png", tmp_path / "missing.log")
    assert "does not exist" in curves_error("log", "--out", tmp_path / "no" / "c.png", log)


def test_the_cpu_clock_spreads_each_runs_cpu_seconds_over_its_updates(tmp_path, capsys):
    """On a machine that others share, wall time measures them too; the CPU time of a run does not."""
    records = [{"epoch": 1, "valid_loss": "3.1", "valid_num_updates": "100"},
               {"epoch": 1, "num_updates": "200", "wall": "7200"},
               {"epoch": 1, "valid_loss": "2.5", "valid_num_updates": "200"}]
    log = write_log(tmp_path / "feedback_2" / "train.log", records)
    cpu_seconds = tmp_path / "feedback_2" / "cpu_seconds"
    cpu_seconds.write_text("3000.5 99.5 120\n3600 0 80\n")  # two processes: resumed
    curves.main(["log", "--out", str(tmp_path / "c.png"), "--metric", "valid_loss", "--label", "valid bits per byte",
                 "--clock", "cpu", str(log)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "| model | updates | valid bits per byte | training hours (CPU) |"
    assert out[2] == "| feedback_2 | 200 | 2.50 | 1.86 |"  # 6,700 s, not the wall clock's 2 h
    assert curves.cpu_hours(str(log), curves.log_points(str(log), "valid_loss"))[0] == (100, 6700 / 2 / 3600, 3.1)
    # a process killed after 60 updates wrote no line: the others' rate stands for the whole run
    cpu_seconds.write_text("3600 0 80\n")
    assert curves.cpu_hours(str(log), curves.log_points(str(log), "valid_loss"))[1] == (200, 3600 / 80 * 200 / 3600, 2.5)
    cpu_seconds.write_text("3000.5 99.5\n")  # the lines of an older script, without the updates
    assert "lines of 'user system updates'" in curves_error("log", "--out", tmp_path / "c.png", "--metric",
                                                            "valid_loss", "--clock", "cpu", log)
    cpu_seconds.unlink()
    assert "--clock cpu reads" in curves_error("log", "--out", tmp_path / "c.png", "--metric", "valid_loss",
                                               "--clock", "cpu", log)


def test_toy_curves_draw_every_model_however_many(tmp_path):
    """The figure once had four colours, and a fifth model was left out of it without a word."""
    results = {f"model{i}": [evaluation("random_walk", 100, 0.07 * i, 0.05 * i, None)] for i in range(13)}
    fig = plots.toy_accuracy(results, "random_walk")
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    # each model, then what the solid and dashed lines and the star are
    assert legend == [*results, "acc", "episode_acc", "best checkpoint (acc), its updates"]
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3 * 13 and len({line.get_color() for line in lines}) == 13  # told apart by colour
    plt.close(fig)


def test_the_price_of_each_run_its_cpu_seconds_and_the_operators_of_its_kind(tmp_path, capsys):
    """price: a run's last validation against its CPU seconds per update and the operators per position
    that feedback-benchmark counted for its kind, read from the configuration fairseq-train logged."""
    runs = {"exact": "'train_passes': 0, 'pass_group': 16, 'no_feedback': False",
            "passes_16x4": "'train_passes': 4, 'pass_group': 16, 'no_feedback': False",
            "transformer": "'train_passes': 0, 'pass_group': 16, 'no_feedback': True",
            "passes_16x4_last": "'train_passes': 4, 'pass_group': 16, 'pass_gradients': last, 'no_feedback': False"}
    logs = []
    for (name, config), value in zip(runs.items(), ("2.4", "2.5", "2.6", "2.7")):
        log = tmp_path / name / "train.log"
        log.parent.mkdir()
        log.write_text("{'model': {" + config + "}}\n" + json.dumps({"valid_loss": value, "valid_num_updates": "100"})
                       + "\n")
        (tmp_path / name / "cpu_seconds").write_text("150 50 100\n")
        logs.append(str(log))
    benchmark = tmp_path / "lm.json"
    benchmark.write_text(json.dumps({"tables": {"lm": {"figures": {"ops/step": {
        "transformer_lm": 60.0, "feedback_lm": 135.6, "feedback_lm (passes 16x4)": 70.4}}}}}))
    curves.main(["price", "--out", str(tmp_path / "price.png"), "--metric", "valid_loss", "--benchmark",
                 str(benchmark), "--", *logs])
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["| exact | 100 | 2.4000 | 2.00 | 136 |", "| passes_16x4 | 100 | 2.5000 | 2.00 | 70 |",
                       "| transformer | 100 | 2.6000 | 2.00 | 60 |",
                       "| passes_16x4_last | 100 | 2.7000 | 2.00 |  |"]  # not what the benchmark's passes count
    assert (tmp_path / "price.png").read_bytes()[:4] == b"\x89PNG"
    assert "not a feedback-benchmark --json file" in curves_error("price", "--out", tmp_path / "p.png",
                                                                  "--benchmark", logs[0], "--", *logs)
