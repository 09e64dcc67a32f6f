"""The feedback LM through fairseq-train, fairseq-eval-lm, fairseq-interactive
and the hub interface, on a tiny generated corpus."""

import pytest
import torch
from helpers import LM_MODEL, last_number, preprocess_lm, run, train_on_two_workers, write_lm_corpus

ADAM = ["--optimizer", "adam", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def trained(lm_run):
    """The shared tiny run (conftest.py): the model trained with ADAM, blocks of 16, 4 streams."""
    return lm_run


def test_training_scores_every_token_and_learns(trained):
    log = trained.log
    train_tokens = sum(len(line.split()) + 1 for line in open(trained.corpus / "train.txt"))
    assert f"train: {train_tokens} tokens, each scored once, in 4 streams" in log
    assert last_number(r"valid on 'valid' subset \| loss ([\d.]+)", log) < last_number(r"epoch 001 .*?loss ([\d.]+)", log)


def test_the_log_file_holds_each_line_once_whatever_the_epochs(trained):
    """fairseq-train adds a --log-file handler at every epoch, and its lines came once per epoch so far."""
    assert "epoch 002" in trained.log
    lines = trained.log_file.read_text().splitlines()
    assert sum(line.startswith("epoch 002") for line in lines) >= 2
    assert [a for a, b in zip(lines, lines[1:]) if a == b] == []


def test_eval_lm_carries_memory_so_the_block_length_does_not_matter(trained):
    """... and a block longer than the longest stream is cut to it, rather than padded (a hundred times slower)."""
    test_tokens = sum(len(line.split()) + 1 for line in open(trained.corpus / "test.txt"))
    results = []
    for block in (16, 128, 100_000):
        out = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path",
                  trained.checkpoint, "--tokens-per-sample", block, "--batch-size", 2,
                  "--gen-subset", "test", "--cpu").stdout
        assert f"Evaluated {test_tokens} tokens" in out
        results.append(last_number(r"Loss \(base 2\): ([\d.]+)", out))
    assert "(--tokens-per-sample 100000 cut to the longest stream)" in out
    assert results[0] == results[1] == results[2]


def test_streams_left_empty_are_left_out_of_the_batches_with_a_warning(trained):
    """More streams than lines: the empty ones would only pad every batch (and
    100,000 of them ran out of memory); without them, the numbers are those of
    any other count of streams that deals each line into a stream of its own.
    More streams asked for than tokens: refused before their layout, which is as
    large as the streams asked for (10**9 took 8 GB before anything refused them)."""
    results = {}
    for rows in (50, 80):  # the test split's 20 lines, one stream each (of 80 tokens or more)
        out = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path",
                  trained.checkpoint, "--batch-size", rows, "--gen-subset", "test",
                  "--cpu").stdout
        results[rows] = last_number(r"Loss \(base 2\): ([\d.]+)", out)
    assert "WARNING | fairseq_feedback.tasks.streams | test: 20 lines fill 20 of the 80 streams asked for " \
           "(--batch-size x workers); the empty ones are left out of the batches" in out
    assert results[50] == results[80]
    # streams from a budget of tokens (--max-tokens; fairseq-eval-lm's 36,000 by default): no more than the tokens
    test_tokens = sum(len(line.split()) + 1 for line in open(trained.corpus / "test.txt"))
    out = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path", trained.checkpoint,
              "--max-tokens", 16_000, "--tokens-per-sample", 16, "--gen-subset", "test", "--cpu").stdout
    assert f"test: 20 lines fill 20 of the {test_tokens} streams asked for" in out
    assert last_number(r"Loss \(base 2\): ([\d.]+)", out) == results[50]
    refused = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path", trained.checkpoint,
                  "--batch-size", 100_000, "--gen-subset", "test", "--cpu", check=False)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].endswith(
        "too few for the 100,000 streams asked for (--batch-size x workers), and its 20 lines fill 20 at most (a "
        "stream starts at a line): pass a --batch-size (--batch-size-valid for validation) of 20 or less"), \
        refused.stderr[-3000:]


def test_sampling_through_interactive_and_the_hub(trained):
    from fairseq_feedback.models import FeedbackLanguageModel

    out = run("interactive", trained.data, "--task", "feedback_language_modeling", "--path",
              trained.checkpoint, "--sampling", "--beam", 1, "--max-len-b", 6, "--cpu",
              stdin="w1 w2 w3\n").stdout
    (hypothesis,) = [line.split("\t")[2] for line in out.splitlines() if line.startswith("H-")]
    assert hypothesis.startswith("w1 w2 w3 ") and len(hypothesis.split()) > 3
    lm = FeedbackLanguageModel.from_pretrained(str(trained.checkpoint.parent), "checkpoint_last.pt", str(trained.data))
    assert lm.sample("w4 w5", beam=1, sampling=True, max_len_b=5).startswith("w4 w5")


def test_resumed_training_continues_the_streams(trained, tmp_path):
    (tmp_path / "checkpoint_last.pt").write_bytes(trained.checkpoint.read_bytes())
    saved = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
    log = run("train", trained.data, *LM_MODEL, *ADAM, "--tokens-per-sample", 16, "--batch-size", 4,
              "--max-update", trained.updates + 5, "--save-dir", tmp_path).stdout
    assert f"@ {trained.updates} updates" in log
    resumed = torch.load(tmp_path / "checkpoint_last.pt")["extra_state"]["train_iterator"]
    assert (resumed["epoch"], resumed["iterations_in_epoch"]) == (saved["epoch"], saved["iterations_in_epoch"] + 5)


@pytest.mark.slow
def test_two_workers_train_to_the_parameters_of_one_worker_with_both_workers_streams(trained, tmp_path):
    common = [trained.data, *LM_MODEL, "--optimizer", "sgd", "--lr", "0.5", "--tokens-per-sample", 16,
              "--max-update", 5, "--ddp-backend", "legacy_ddp"]
    run("train", *common, "--batch-size", 4, "--save-dir", tmp_path / "one")
    log = train_on_two_workers(*common, "--batch-size", 2, "--save-dir", tmp_path / "two")
    assert "in 4 streams of" in log and "(2 streams on this worker)" in log
    one = torch.load(tmp_path / "one" / "checkpoint_last.pt")["model"]
    two = torch.load(tmp_path / "two" / "checkpoint_last.pt")["model"]
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=0)


def last_line(proc):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if line.strip()][-1]


def test_missing_split_is_one_line(trained):
    proc = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path",
               trained.checkpoint, "--gen-subset", "nosuch", "--cpu", check=False)
    assert last_line(proc).startswith(f"error: split 'nosuch' not found in {trained.data}")


def test_block_longer_than_the_model_allows_is_one_line(trained, tmp_path):
    absolute = ["--relative-positions", "False", "--no-token-positional-embeddings", "False",
                "--max-target-positions", 32]
    run("train", trained.data, *LM_MODEL, *ADAM, *absolute, "--tokens-per-sample", 16, "--batch-size", 2,
        "--max-update", 1, "--save-dir", tmp_path)
    proc = run("eval_lm", trained.data, "--task", "feedback_language_modeling", "--path",
               tmp_path / "checkpoint_last.pt", "--tokens-per-sample", 64, "--cpu", check=False)
    assert last_line(proc) == "error: --tokens-per-sample 64 is longer than the model allows (32): use shorter blocks"


def test_labels_that_do_not_align_are_one_line(tmp_path):
    write_lm_corpus(tmp_path / "corpus", 30)
    labels = tmp_path / "labels"
    labels.mkdir()
    for split in ("train", "valid", "test"):
        lines = open(tmp_path / "corpus" / f"{split}.txt").read().splitlines()
        aligned = [" ".join("_" if i % 2 else "x" for i, _ in enumerate(line.split())) for line in lines]
        if split == "train":
            aligned[4] += " x"  # one label too many on line 5
        (labels / f"{split}.txt").write_text("\n".join(aligned) + "\n")
    preprocess_lm(tmp_path / "corpus", tmp_path / "data-bin")
    preprocess_lm(labels, tmp_path / "data-bin" / "labels")
    proc = run("train", tmp_path / "data-bin", *LM_MODEL, *ADAM, "--labels", "labels", "--tokens-per-sample", 16,
               "--batch-size", 2, "--max-update", 1, "--save-dir", tmp_path / "checkpoints", check=False)
    assert last_line(proc).startswith(f"error: labels {tmp_path / 'data-bin' / 'labels' / 'train'} do not align "
                                      f"with {tmp_path / 'data-bin' / 'train'} (line 5 differs)")
    assert not (tmp_path / "checkpoints").exists()  # found once fairseq-train had made it: removed again
