"""The paper's BPTT warm-up (appendix, enwik8: blocks of 64 for the first half
of training, then 128) as fairseq-train runs it with --bptt-warmup-tokens-per-sample,
and the authors' random epoch offset (--random-epoch-offset, their trainer.py):
the block length changes where an epoch begins, each epoch reads every stream
from a random token under one block on, every token after it once, and a run
resumed anywhere trains the same blocks."""

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
    """(update, block number, block length, the rows' targets as words, their first inputs) of every
    training step."""
    seen = []
    train_step = FeedbackLanguageModelingTask.train_step

    def recorded(task, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        target, first_inputs = sample["target"], sample["net_input"]["src_tokens"][:, 0].tolist()
        words = [[task.dictionary[t] for t in row if t != task.dictionary.pad()] for row in target.tolist()]
        seen.append((update_num + 1, sample["net_input"]["block_index"], target.size(1), words,
                     [task.dictionary[t] for t in first_inputs]))
        return train_step(task, sample, model, criterion, optimizer, update_num, ignore_grad)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(FeedbackLanguageModelingTask, "train_step", recorded)
        yield seen


def train(data, save_dir, updates, *extra):
    return run("train", data, *LM_MODEL, *WARMUP, "--max-update", updates, "--save-dir", save_dir, *extra)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The blocks of 42 updates in one go, each epoch from a random offset, and the log."""
    with recording_blocks() as blocks:
        log = train(data[0], tmp_path_factory.mktemp("one-go"), 42, "--random-epoch-offset").stdout
    return blocks, log


def epochs(blocks):
    """The steps of each epoch (an epoch begins at block 0)."""
    starts = [i for i, step in enumerate(blocks) if step[1] == 0] + [len(blocks)]
    return [blocks[a:b] for a, b in zip(starts, starts[1:])]


def test_the_first_epochs_train_on_short_blocks_each_from_a_random_offset(data, uninterrupted):
    _, tokens = data
    blocks, log = uninterrupted
    by_epoch = epochs(blocks)
    # the epochs that begin before update 20 (the first half) in blocks of 8, the rest in blocks of 16
    lengths = [8, 8] + [16] * (len(by_epoch) - 2)
    assert [{length for _, _, length, _, _ in e} for e in by_epoch] == [{n} for n in lengths]
    summaries = re.findall(r"(train|valid): (?:\d+ tokens, each scored once|\d+ of its \d+ tokens \(each stream from "
                           r"its token (\d+) on\)), in 4 streams of up to \d+ blocks of (\d+) tokens", log)
    offsets = [int(offset or 0) for split, offset, _ in summaries if split == "train"]
    assert [int(block) for split, _, block in summaries if split == "train"] == lengths
    assert all(0 <= offset < block for offset, block in zip(offsets, lengths))
    assert len(set(offsets)) > 1  # seed 1's draws: the blocks move from epoch to epoch
    # validation reads every token, from the start of each stream
    assert {(split, offset) for split, offset, _ in summaries if split == "valid"} == {("valid", "")}
    for epoch, offset in zip(by_epoch[:-1], offsets):  # the last one --max-update cuts short
        # each stream read in order from its token `offset`, its first input the token before (an end of line
        # where the stream starts at a line): the split, less the first `offset` tokens of each stream
        at = 0
        for row in range(4):
            stream = [w for _, _, _, rows, _ in epoch for w in rows[row]]
            at += offset
            assert stream == tokens[at:at + len(stream)]
            assert epoch[0][4][row] == (tokens[at - 1] if at else "</s>")
            at += len(stream)
        assert at == len(tokens)


def test_a_run_resumed_anywhere_trains_the_blocks_of_an_uninterrupted_one(data, uninterrupted, tmp_path):
    # mid-way through the last epoch of the warm-up (begun before update 20, still in blocks of 8), at the
    # end of that epoch (the next one draws its offset after the resumption), and mid-way through an epoch
    # of blocks of 16
    first, second = [len(e) for e in epochs(uninterrupted[0])][:2]
    stops = (first + 2, first + second, first + second + 3)
    with recording_blocks() as blocks:
        for stop in stops:
            train(data[0], tmp_path, stop, "--random-epoch-offset")
            state = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
            assert state["updates"] == stop
    assert blocks == uninterrupted[0][:stops[-1]]


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
