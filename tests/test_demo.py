"""The demo's pieces: its table and plot, the folder it replaces only when it is its own, the
checkpoints it evaluates and the commands it runs."""

import os
import sys

import pytest
from helpers import run, run_module

from fairseq_feedback_cli import demo, plots
from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.outputs import atomic_folder
from fairseq_feedback_cli.toy import scoring


def fake_results():
    def r(updates, acc, episode):
        return {"updates": updates, "acc": acc, "episode_acc": episode, "checkpoint": f"checkpoint_1_{updates}.pt"}

    # the feedback model dips at its last checkpoint; the transformer's one episode solved does not decide
    return {"feedback": [r(100, 0.5, 0.0), r(200, 0.9, 0.25), r(300, 0.85, 0.2)],
            "transformer": [r(100, 0.3, 0.0), r(200, 0.35, 0.0), r(300, 0.33, 0.002)]}


def test_demo_table_and_plot(tmp_path):
    text = demo.table(fake_results(), "random_walk")
    lines = text.splitlines()
    assert lines[0].split("|")[1:-1] == [c.rjust(len(c)) for c in lines[0].split("|")[1:-1]]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "updates", "feedback acc", "feedback episode_acc", "transformer acc", "transformer episode_acc"]
    assert [c.strip() for c in lines[3].strip("|").split("|")] == ["200", "90.0", "25.0", "35.0", "0.0"]
    plots.save(plots.toy_accuracy(fake_results(), "random_walk", title="t"), tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_names_the_best_checkpoint_not_the_last():
    assert demo.best_line(fake_results(), "random_walk") == (
        "Best tested checkpoint (by acc, then episode_acc): feedback at 200 updates (90.0 / 25.0, "
        "`feedback/checkpoint_1_200.pt`); transformer at 200 updates (35.0 / 0.0, `transformer/checkpoint_1_200.pt`).")
    # equal tokens: the more episodes, then the earlier checkpoint
    same = fake_results()["transformer"][1]
    tied = [dict(same, updates=400), dict(same, updates=500), dict(same, updates=600, episode_acc=0.002)]
    assert scoring.best("random_walk", tied)["updates"] == 600
    assert scoring.best("random_walk", tied[:2])["updates"] == 400
    # the figure stars each model's best on its token curve, labelled with its updates
    ax = plots.toy_accuracy(fake_results(), "random_walk").axes[0]
    stars = [line.get_xydata().tolist() for line in ax.lines if line.get_marker() == "*"]
    assert stars == [[[200, 90.0]], [[200, 35.0]]]
    assert [t.get_text() for t in ax.texts] == ["200", "200"]


def test_demo_keeps_the_last_and_the_best_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "feedback"
    save_dir.mkdir()
    for name in ("checkpoint_1_100.pt", "checkpoint_1_200.pt", "checkpoint_1_300.pt", "checkpoint_last.pt"):
        (save_dir / name).write_text("")
    scores = {r["updates"]: r for r in fake_results()["feedback"]}

    def evaluate(task, data, path, split, raw, output):
        updates = int(os.path.basename(path)[len("checkpoint_1_"):-len(".pt")])
        return dict(scores[updates], checkpoint=path, predictions=output)

    monkeypatch.setattr(demo, "evaluate", evaluate)
    monkeypatch.setattr(demo, "checkpoint_updates", lambda path: 300)  # checkpoint_last.pt's
    results = demo.evaluate_model("feedback", str(save_dir), "raw", "bin", demo.CONFIG)
    assert [r["updates"] for r in results] == [100, 200, 300]
    assert sorted(p.name for p in save_dir.glob("*.pt")) == ["checkpoint_1_200.pt", "checkpoint_last.pt"]


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


def test_demo_checkpoints_and_commands(toy_model, tmp_path):
    _, data, ckpt = toy_model
    found, final = demo.checkpoints(str(ckpt.parent), 3)
    assert found == {3: str(ckpt)} and final == 3
    cmd = demo.train_command(str(data), str(tmp_path), demo.CONFIG, demo.MODELS["transformer"])
    assert "--no-feedback" in cmd
    # the rate decays to 0 at the last update, whatever --updates says
    assert cmd[cmd.index("--max-update") + 1] == cmd[cmd.index("--total-num-update") + 1] == str(demo.CONFIG["updates"])


def commands_in_this_process(cmd, log_path, env):
    """demo.run_checked, with its `python -m MODULE ARGS` run in this process: fairseq-preprocess, or the module's
    main; what it printed and logged goes to its log."""
    python, option, module, *args = cmd
    assert (python, option) == (sys.executable, "-m"), cmd
    proc = run("preprocess", *args) if module == "fairseq_cli.preprocess" else run_module(module, *args)
    with open(log_path, "w") as log:
        log.write(proc.stdout + proc.stderr)


@pytest.mark.parametrize("where", ["in this process", pytest.param("as processes", marks=pytest.mark.slow)])
def test_demo_data_is_the_generated_task_binarized_with_its_labels(tmp_path, monkeypatch, where):
    if where == "in this process":
        monkeypatch.setattr(demo, "run_checked", commands_in_this_process)
    raw, data = demo.make_data(str(tmp_path / "data"), demo.TINY, demo.child_env(1))
    lines = {kind: (tmp_path / "data" / "raw" / "random_walk" / f"test.{kind}").read_text().splitlines()
             for kind in ("input", "labels")}
    assert raw == str(tmp_path / "data" / "raw" / "random_walk") and len(lines["input"]) == demo.TINY["sizes"]["test"]
    assert [len(line.split()) for line in lines["input"]] == [len(line.split()) for line in lines["labels"]]
    binarized = {"dict.txt"} | {f"{split}.{ext}" for split in ("train", "valid", "test") for ext in ("bin", "idx")}
    assert binarized <= set(os.listdir(data)) and binarized <= set(os.listdir(os.path.join(data, "labels")))
