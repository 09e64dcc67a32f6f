"""fairseq's data classes that still read numpy 1's np.compat.long run on the numpy `make setup`
installs (numpy 2, which removed it), through fairseq's tools: TokenBlockDataset in its "eos" mode
(fairseq-interactive on a language model, fairseq-train --sample-break-mode eos) and
LanguagePairDataset's length buckets (--num-batch-buckets). A program of one's own that imports the
plugin and builds them: tests/test_reliability.py."""

from helpers import (LM_MODEL, TRANSLATION_MODEL, last_number, preprocess_lm, preprocess_translation, run,
                     write_lm_corpus)

from fairseq_feedback_cli.data_prep.synthetic_translation import write_corpus

ONE_UPDATE = ["--optimizer", "adam", "--lr", "1e-3", "--max-update", 1]


def test_language_models_read_prompts_and_train_on_lines_through_token_blocks(tmp_path):
    write_lm_corpus(tmp_path / "corpus", 40)
    preprocess_lm(tmp_path / "corpus", tmp_path / "data")
    run("train", tmp_path / "data", *LM_MODEL, *ONE_UPDATE, "--tokens-per-sample", 16, "--batch-size", 2,
        "--save-dir", tmp_path / "feedback")
    out = run("interactive", tmp_path / "data", "--task", "feedback_language_modeling", "--path",
              tmp_path / "feedback" / "checkpoint_last.pt", "--beam", 1, "--max-len-b", 3, "--cpu",
              stdin="w1 w2 w3\n").stdout
    assert [line.split("\t")[2].split()[:3] for line in out.splitlines() if line.startswith("H-")] == [
        ["w1", "w2", "w3"]]
    # fairseq's own language model, one line a sample
    log = run("train", tmp_path / "data", "--task", "language_modeling", "--arch", "transformer_lm",
              "--decoder-layers", 1, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
              "--decoder-attention-heads", 2, "--sample-break-mode", "eos", "--tokens-per-sample", 16,
              "--batch-size", 2, *ONE_UPDATE, "--cpu", "--save-dir", tmp_path / "transformer").stdout
    assert last_number(r"num_updates (\d+)", log) == 1


def test_translation_trains_and_generates_with_length_buckets(tmp_path):
    write_corpus(str(tmp_path / "corpus"), {"train": 16, "valid": 4, "test": 5}, vocab=12, max_len=6)
    preprocess_translation(tmp_path / "corpus", tmp_path / "data")
    buckets = ["--num-batch-buckets", 2, "--max-tokens", 100]  # fairseq batches buckets by tokens only
    run("train", tmp_path / "data", *TRANSLATION_MODEL, *ONE_UPDATE, *buckets, "--save-dir", tmp_path / "model")
    out = run("generate", tmp_path / "data", "--path", tmp_path / "model" / "checkpoint_last.pt", *buckets,
              "--beam", 2, "--max-len-b", 4, "--cpu").stdout
    translated = [int(line[2:].split("\t")[0]) for line in out.splitlines() if line.startswith("H-")]
    assert sorted(translated) == list(range(5))
