"""The corpora the steps train on: data_prep's synthetic translation corpus, binarized by
fairseq-preprocess for translation (steps 2 and 4) or as language-model text (step 3c)."""

from .check import Check, Command


def generated_corpus(check: Check, name: str, corpus: list) -> str:
    """data_prep's synthetic translation corpus, in work/NAME/raw."""
    raw = check.path("work", name, "raw")
    check.run(Command("fairseq_feedback_cli.data_prep.synthetic_translation", ["--out", raw, *corpus, "--test", 1],
                      f"{name}-corpus.log"))
    return raw


def parallel_corpus(check: Check, name: str, corpus: list) -> str:
    """The synthetic corpus binarized for translation (src -> tgt, one dictionary): its data directory."""
    raw, data = generated_corpus(check, name, corpus), check.path("work", name, "data-bin")
    check.run(Command("fairseq_cli.preprocess", ["--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                                                 f"{raw}/train", "--validpref", f"{raw}/valid", "--destdir", data,
                                                 "--joined-dictionary", "--workers", 1], f"{name}-preprocess.log"))
    return data


def text_corpus(check: Check, name: str, corpus: list) -> str:
    """The synthetic corpus's source side binarized as language-model text: its data directory."""
    raw, data = generated_corpus(check, name, corpus), check.path("work", name, "data-bin")
    check.run(Command("fairseq_cli.preprocess", ["--only-source", "--trainpref", f"{raw}/train.src", "--validpref",
                                                 f"{raw}/valid.src", "--destdir", data, "--workers", 1],
                      f"{name}-preprocess.log"))
    return data
