"""feedback-average-checkpoints: the mean of checkpoints' parameters, as fairseq's scripts/average_checkpoints.py."""

import argparse
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_one_error_line, error_of, run_as_a_user

from fairseq_feedback_cli import average_checkpoints


def _checkpoint(path: Path, seed: int, dtype=torch.float32, extra=None, **model):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype),
              "steps": torch.tensor([seed * 3 + 1]), **model}
    state = {"args": argparse.Namespace(arch="feedback_transformer", seed=seed), "model": params,
             "optimizer_history": [{"num_updates": seed}], "extra_state": {"epoch": seed}}
    if extra is not None:
        state["extra"] = extra
    torch.save(state, path)
    return params


def average(*argv):
    average_checkpoints.main([str(a) for a in argv])


def test_average_of_the_last_epochs_is_the_mean_of_their_parameters(tmp_path):
    params = {e: _checkpoint(tmp_path / f"checkpoint{e}.pt", seed=e) for e in (1, 2, 3, 10)}
    _checkpoint(tmp_path / "checkpoint_last.pt", seed=99)
    _checkpoint(tmp_path / "checkpoint_3_300.pt", seed=98)
    average("--inputs", tmp_path, "--num-epoch-checkpoints", 3, "--output", tmp_path / "avg.pt")
    state = torch.load(tmp_path / "avg.pt")
    last = [params[e] for e in (10, 3, 2)]  # by epoch number, not by name: 10 after 3
    torch.testing.assert_close(state["model"]["w"], torch.stack([p["w"] for p in last]).mean(0))
    torch.testing.assert_close(state["model"]["b"], torch.stack([p["b"] for p in last]).mean(0))
    assert state["model"]["steps"].item() == (31 + 10 + 7) // 3  # integers: floor division
    assert state["extra_state"] == {"epoch": 10} and state["args"].seed == 10  # the rest: the newest's
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []

    average("--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--checkpoint-upper-bound", 2,
            "--output", tmp_path / "upto2.pt")
    torch.testing.assert_close(torch.load(tmp_path / "upto2.pt")["model"]["w"], (params[1]["w"] + params[2]["w"]) / 2)


def test_average_by_updates_and_of_named_files_and_half_precision(tmp_path):
    a = _checkpoint(tmp_path / "checkpoint_1_100.pt", seed=1)
    b = _checkpoint(tmp_path / "checkpoint_2_1000.pt", seed=2)
    _checkpoint(tmp_path / "checkpoint_1_200.pt", seed=3)
    average("--inputs", tmp_path, "--num-update-checkpoints", 2, "--output", tmp_path / "avg.pt")
    c = torch.load(tmp_path / "checkpoint_1_200.pt")["model"]
    torch.testing.assert_close(torch.load(tmp_path / "avg.pt")["model"]["w"], (b["w"] + c["w"]) / 2)

    h1 = _checkpoint(tmp_path / "h1.pt", seed=1, dtype=torch.float16)
    h2 = _checkpoint(tmp_path / "h2.pt", seed=2, dtype=torch.float16)
    average("--inputs", tmp_path / "h1.pt", tmp_path / "h2.pt", "--output", tmp_path / "out" / "h.pt")
    w = torch.load(tmp_path / "out" / "h.pt")["model"]["w"]
    assert w.dtype == torch.float32  # as fairseq: half precision averaged into float32
    torch.testing.assert_close(w, (h1["w"].float() + h2["w"].float()) / 2)
    del a


def test_average_errors_are_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "avg.pt"
    (tmp_path / "empty").mkdir()
    assert "found 0 checkpoint<epoch>.pt files" in error_of(
        average, "--inputs", tmp_path / "empty", "--num-epoch-checkpoints", 10, "--output", out)
    _checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    assert "found 1 checkpoint<epoch>.pt files in" in error_of(
        average, "--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--output", out)
    assert "not a folder" in error_of(
        average, "--inputs", tmp_path / "nothing-here", "--num-epoch-checkpoints", 2, "--output", out)
    assert "is a folder" in error_of(average, "--inputs", tmp_path, "--output", out)
    assert "not found" in error_of(average, "--inputs", tmp_path / "missing.pt", "--output", out)
    assert "at least 1" in error_of(average, "--inputs", tmp_path, "--num-epoch-checkpoints", 0, "--output", out)
    assert "--output" in error_of(average, "--inputs", tmp_path / "checkpoint1.pt")

    _checkpoint(tmp_path / "other.pt", seed=2, extra_param=torch.zeros(2))
    assert "other parameters" in error_of(
        average, "--inputs", tmp_path / "checkpoint1.pt", tmp_path / "other.pt", "--output", out)
    torch.save({"model": {"w": torch.zeros(5, 4), "b": torch.zeros(4), "steps": torch.tensor([1])}},
               tmp_path / "shape.pt")
    assert "has shape (5, 4)" in error_of(
        average, "--inputs", tmp_path / "checkpoint1.pt", tmp_path / "shape.pt", "--output", out)
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    assert "is a text file (it begins 'not a checkpoint'), not a checkpoint" in error_of(
        average, "--inputs", tmp_path / "broken.pt", "--output", out)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    assert "holds no model's parameters" in error_of(average, "--inputs", tmp_path / "plain.pt", "--output", out)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_an_average_over_one_of_the_checkpoints_of_its_folder_is_refused(tmp_path):
    """--inputs CK --num-epoch-checkpoints 2 --output CK/checkpoint4.pt replaced checkpoint4.pt, exit 0, whether
    it was averaged or not."""
    for epoch in (3, 4):
        _checkpoint(tmp_path / f"checkpoint{epoch}.pt", seed=epoch)
    before = (tmp_path / "checkpoint4.pt").read_bytes()
    assert "a checkpoint that training wrote" in error_of(average, "--inputs", tmp_path, "--num-epoch-checkpoints", 2,
                                                          "--output", tmp_path / "checkpoint4.pt")
    assert (tmp_path / "checkpoint4.pt").read_bytes() == before
    _checkpoint(tmp_path / "checkpoint2.pt", seed=2)  # and one it does not average, which training wrote
    assert "a checkpoint that training wrote" in error_of(average, "--inputs", tmp_path, "--num-epoch-checkpoints", 2,
                                                          "--output", tmp_path / "checkpoint2.pt")
    average("--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--output", tmp_path / "checkpoint.avg.pt")
    average("--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--output", tmp_path / "checkpoint.avg.pt")  # again


def lm_checkpoint(path, data, memory_span=1024, **args):
    """A feedback_lm checkpoint as fairseq-train records its options (every option in one Namespace)."""
    g = torch.Generator().manual_seed(len(str(path)))
    args = {"arch": "feedback_lm", "decoder_layers": 2, "seed": 1, "lr": [0.1], **args}
    state = {"args": argparse.Namespace(memory_span=memory_span, data=str(data), **args),
             "model": {"w": torch.randn(3, 4, generator=g)}}
    torch.save(state, path)


def dictionary(folder, symbols):
    folder.mkdir(exist_ok=True)
    (folder / "dict.txt").write_text("".join(f"{symbol} {100 - i}\n" for i, symbol in enumerate(symbols)))
    return folder


def test_checkpoints_of_other_models_or_dictionaries_are_refused_not_averaged(tmp_path):
    """Their parameters fit either way: fairseq averaged checkpoints trained with --memory-span 1024 and 3,
    and language models whose dictionaries hold the same symbols in another order, with exit status 0."""
    out, data = tmp_path / "avg.pt", dictionary(tmp_path / "data", ["the", "cat", "sat"])
    lm_checkpoint(tmp_path / "a.pt", data)
    lm_checkpoint(tmp_path / "span.pt", data, memory_span=3)
    assert error_of(average, "--inputs", tmp_path / "a.pt", tmp_path / "span.pt", "--output", out) == (
        f"error: {tmp_path / 'span.pt'} was trained with --memory-span 3, and {tmp_path / 'a.pt'} with --memory-span "
        "1024: average checkpoints of one model only")
    lm_checkpoint(tmp_path / "arch.pt", data, arch="feedback_transformer")
    assert "holds another architecture than" in error_of(average, "--inputs", tmp_path / "a.pt", tmp_path / "arch.pt",
                                                         "--output", out)
    for name, symbols in (("shuffled", ["cat", "the", "sat"]), ("other", ["the", "cat", "mat"])):
        lm_checkpoint(tmp_path / f"{name}.pt", dictionary(tmp_path / name, symbols))
        assert error_of(average, "--inputs", tmp_path / "a.pt", tmp_path / f"{name}.pt", "--output", out) == (
            f"error: {tmp_path / name}.pt was trained with a dict.txt of "
            + ("the same symbols in another order" if name == "shuffled" else "other symbols")
            + f" than {tmp_path / 'a.pt'}'s: the rows of its embeddings are other words; average checkpoints "
              "trained on one data directory only")
    assert not out.exists()
    # what may change when a run resumes (regularisation, how it is computed), and options of training alone
    lm_checkpoint(tmp_path / "b.pt", dictionary(tmp_path / "copy", ["the", "cat", "sat"]), dropout=0.3,
                  cuda_graphs="off", lr=[0.01], seed=2)
    average("--inputs", tmp_path / "a.pt", tmp_path / "b.pt", "--output", out)
    assert out.exists()


def test_the_average_gets_the_umasks_permissions(tmp_path):
    _checkpoint(tmp_path / "a.pt", seed=1)
    previous = os.umask(0o022)
    try:
        average("--inputs", tmp_path / "a.pt", "--output", tmp_path / "avg.pt")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "avg.pt").st_mode & 0o777 == 0o644  # as torch.save would have made it


class Payload:
    def __reduce__(self):
        return (os.system, ("echo this checkpoint ran code",))


def test_a_checkpoint_holding_code_is_refused_not_run(tmp_path, capfd):
    _checkpoint(tmp_path / "evil.pt", seed=1, extra=Payload())
    message = error_of(average, "--inputs", tmp_path / "evil.pt", "--output", tmp_path / "avg.pt")
    assert "holds objects a fairseq checkpoint does not" in message
    assert "ran code" not in capfd.readouterr().out
    assert not (tmp_path / "avg.pt").exists()


def test_a_failed_write_leaves_no_output(tmp_path, monkeypatch):
    _checkpoint(tmp_path / "a.pt", seed=1)
    (tmp_path / "avg.pt").write_bytes(b"the previous average")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    assert "No space left" in error_of(average, "--inputs", tmp_path / "a.pt", "--output", tmp_path / "avg.pt")
    assert (tmp_path / "avg.pt").read_bytes() == b"the previous average"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "avg.pt"]


@pytest.mark.slow
def test_a_command_line_error_is_one_line_without_traceback(tmp_path):
    assert_one_error_line(run_as_a_user("fairseq_feedback_cli.average_checkpoints", "--inputs", ".",
                                        "--num-epoch-checkpoints", 3, "--output", "a.pt", cwd=tmp_path))
    assert not (tmp_path / "a.pt").exists()
