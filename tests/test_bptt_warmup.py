"""The paper's BPTT warm-up (appendix, enwik8: blocks of 64 for the first half
of training, then 128) as fairseq-train runs it with --bptt-warmup-tokens-per-sample:
the block length changes where an epoch begins, every token is scored once
per epoch, and a run resumed anywhere trains the same blocks."""

import contextlib
import re

import pytest
import torch
from helpers import LM_MODEL, error_lines, run

from fairseq_feedback.tasks import FeedbackLanguageModelingTask

# 4 streams of about 110 tokens: 14 blocks of 8 tokens per epoch, or 7 of 16
WARMUP = ["--tokens-per-sample", 16, "--bptt-warmup-tokens-per-sample", 8, "--bptt-warmup-updates", 20,
          "--batch-size", 4, "--optimizer", "sgd", "--lr", "0.1"]


@pytest.fixture(scope="module")
def data(lm_data):
    """The shared corpus (conftest.py): its data directory, and its training split's tokens in order."""
    corpus, data = lm_data
    tokens = [line.split() + ["</s>"] for line in open(corpus / "train.txt")]
    return data, [t for line in tokens for t in line]


@contextlib.contextmanager
def recording_blocks():
    """(update, block number, block length, the rows' targets as words) of every training step."""
    seen = []
    train_step = FeedbackLanguageModelingTask.train_step

    def recorded(task, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        target = sample["target"]
        words = [[task.dictionary[t] for t in row if t != task.dictionary.pad()] for row in target.tolist()]
        seen.append((update_num + 1, sample["net_input"]["block_index"], target.size(1), words))
        return train_step(task, sample, model, criterion, optimizer, update_num, ignore_grad)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(FeedbackLanguageModelingTask, "train_step", recorded)
        yield seen


def train(data, save_dir, updates, *extra):
    return run("train", data, *LM_MODEL, *WARMUP, "--max-update", updates, "--save-dir", save_dir, *extra)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The blocks of 42 updates in one go, and the log."""
    with recording_blocks() as blocks:
        log = train(data[0], tmp_path_factory.mktemp("one-go"), 42).stdout
    return blocks, log


def epochs(blocks):
    """The steps of each epoch (an epoch begins at block 0)."""
    starts = [i for i, step in enumerate(blocks) if step[1] == 0] + [len(blocks)]
    return [blocks[a:b] for a, b in zip(starts, starts[1:])]


def test_the_first_epochs_train_on_short_blocks_and_every_token_is_scored_once_per_epoch(data, uninterrupted):
    _, tokens = data
    blocks, log = uninterrupted
    by_epoch = epochs(blocks)
    assert [len(e) for e in by_epoch] == [14, 14, 7, 7]
    # the epochs that begin before update 20 (the first half) in blocks of 8, the rest in blocks of 16
    assert [{length for _, _, length, _ in e} for e in by_epoch] == [{8}, {8}, {16}, {16}]
    assert [int(n) for n in re.findall(r"train: \d+ tokens, each scored once, in 4 streams of up to \d+ blocks "
                                       r"of (\d+) tokens", log)] == [8, 8, 16, 16]
    for epoch in by_epoch:  # each stream read in order, the streams one after another: the split, once
        streams = [[w for _, _, _, rows in epoch for w in rows[r]] for r in range(4)]
        assert [w for stream in streams for w in stream] == tokens


def test_a_run_resumed_anywhere_trains_the_blocks_of_an_uninterrupted_one(data, uninterrupted, tmp_path):
    # mid-way through the last epoch of the warm-up (begun before update 20, still in blocks of 8), at the
    # end of that epoch, and mid-way through an epoch of blocks of 16
    with recording_blocks() as blocks:
        for stop in (22, 28, 31):
            train(data[0], tmp_path, stop)
            state = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
            assert state["updates"] == stop
    assert blocks == uninterrupted[0][:31]


def test_resuming_mid_epoch_in_a_block_length_the_schedule_does_not_give_is_one_line(data, tmp_path):
    data, _ = data
    train(data, tmp_path, 3)
    proc = run("train", data, *LM_MODEL, *WARMUP[:2], "--bptt-warmup-tokens-per-sample", 4,
               *WARMUP[4:], "--max-update", 6, "--save-dir", tmp_path, check=False)
    assert error_lines(proc) == [
        "error: the checkpoint stopped 3 blocks into epoch 1 with 4 streams of 8-token blocks; this run would "
        "continue in 4 streams of 4-token blocks, training some tokens twice: resume with --tokens-per-sample 8 "
        "and 4 streams (--batch-size x workers), or pass --reset-dataloader to start the data over at epoch 1"]


@pytest.mark.parametrize("flags", [["--bptt-warmup-tokens-per-sample", 8], ["--bptt-warmup-updates", 20]])
def test_half_a_warmup_is_one_line(data, tmp_path, flags):
    data, _ = data
    proc = run("train", data, *LM_MODEL, "--tokens-per-sample", 16, "--batch-size", 4, *flags,
               "--max-update", 1, "--save-dir", tmp_path / "save", check=False)
    assert error_lines(proc) == [
        "error: a BPTT warm-up needs both --bptt-warmup-tokens-per-sample (its block length) and "
        "--bptt-warmup-updates (above 0: how long it lasts); give both or neither"]
    assert not (tmp_path / "save").exists()
