"""fairseq's data classes that still read numpy 1's np.compat.long run on the numpy `make setup`
installs (numpy 2, which removed it), through fairseq's tools: TokenBlockDataset in its "eos" mode
(fairseq-interactive on a language model, fairseq-train --sample-break-mode eos) and
LanguagePairDataset's length buckets (--num-batch-buckets, whose np.percentile lost
`interpolation`). Each test first shows that this numpy lacks what fairseq calls, so that it fails
on numpy 1, where it would pass whatever the fix does. A program of one's own that imports the
plugin and builds them: tests/test_reliability.py."""

import numpy as np
import pytest
from helpers import TRANSLATION_MODEL, last_number, run

ONE_UPDATE = ["--optimizer", "adam", "--lr", "1e-3", "--max-update", 1]


def test_language_models_read_prompts_and_train_on_lines_through_token_blocks(lm_run, tmp_path):
    assert not hasattr(np, "compat"), f"numpy {np.__version__} has np.compat: these runs would not need the fix"
    out = run("interactive", lm_run.data, "--task", "feedback_language_modeling", "--path", lm_run.checkpoint,
              "--beam", 1, "--max-len-b", 3, "--cpu", stdin="w1 w2 w3\n").stdout
    assert [line.split("\t")[2].split()[:3] for line in out.splitlines() if line.startswith("H-")] == [
        ["w1", "w2", "w3"]]
    # fairseq's own language model, one line a sample
    log = run("train", lm_run.data, "--task", "language_modeling", "--arch", "transformer_lm",
              "--decoder-layers", 1, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
              "--decoder-attention-heads", 2, "--sample-break-mode", "eos", "--tokens-per-sample", 16,
              "--batch-size", 2, *ONE_UPDATE, "--cpu", "--save-dir", tmp_path / "transformer").stdout
    assert last_number(r"num_updates (\d+)", log) == 1


def test_translation_trains_and_generates_with_length_buckets(translation_data, tmp_path):
    with pytest.raises(TypeError, match="interpolation"):
        np.percentile([1, 2], 50, interpolation="linear")
    buckets = ["--num-batch-buckets", 2, "--max-tokens", 100]  # fairseq batches buckets by tokens only
    run("train", translation_data, *TRANSLATION_MODEL, *ONE_UPDATE, *buckets, "--save-dir", tmp_path / "model")
    out = run("generate", translation_data, "--path", tmp_path / "model" / "checkpoint_last.pt", *buckets,
              "--beam", 2, "--max-len-b", 4, "--cpu").stdout
    translated = [int(line[2:].split("\t")[0]) for line in out.splitlines() if line.startswith("H-")]
    assert sorted(translated) == list(range(8))  # every sentence of the test split
