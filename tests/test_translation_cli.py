"""End to end through fairseq's own tools on a tiny generated parallel corpus:
preprocess, train, generate (beam, n-best, sampling) with sacreBLEU,
interactive, the hub interface, and training resumed from checkpoint_last."""

import pickle
import re

import pytest
import torch
from helpers import (TRANSLATION_MODEL, last_number, preprocess_translation, run, run_module,
                     train_on_two_workers)

from fairseq_feedback.errors import FeedbackUsageError
from fairseq_feedback.models import FeedbackTransformerModel

ADAM = ["--optimizer", "adam", "--adam-betas", "(0.9,0.98)", "--lr", "5e-3", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "30"]
TINY = [*TRANSLATION_MODEL, *ADAM, "--max-tokens", "300"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("translation")
    corpus, data, checkpoints = root / "corpus", root / "data-bin", root / "checkpoints"
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", corpus, "--train", 2000, "--vocab", 12,
               "--max-len", 8)
    preprocess_translation(corpus, data)
    # 800 updates of 300 tokens learn the task (BLEU near 100 under each of the CPU's kernel sets);
    # 400 of 1000, for the same time, left it half learnt, its translations up to the kernels' rounding
    log = run("train", data, *TINY, "--max-update", 800, "--save-dir", checkpoints).stdout
    return data, checkpoints, log


def test_training_learns_the_task_and_generate_scores_it_with_sacrebleu(trained):
    data, checkpoints, log = trained
    first_loss = last_number(r"epoch 001 \| loss ([\d.]+)", log)
    assert last_number(r"valid on 'valid' subset \| loss ([\d.]+)", log) < first_loss / 2
    out = run("generate", data, "--path", checkpoints / "checkpoint_last.pt", "--beam", 5,
              "--scoring", "sacrebleu", "--cpu").stdout
    assert last_number(r"BLEU = ([\d.]+)", out) > 40


def test_generate_translates_every_test_sentence(trained, tmp_path):
    """fairseq drops a last batch smaller than --required-batch-size-multiple
    (8); the plugin gives those sentences back."""
    data, checkpoints, _ = trained
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", tmp_path / "corpus", "--train", 20,
               "--valid", 5, "--test", 13, "--vocab", 12)
    run("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--testpref", tmp_path / "corpus" / "test",
        "--destdir", tmp_path / "data", "--srcdict", data / "dict.src.txt", "--tgtdict", data / "dict.tgt.txt",
        "--workers", "1")
    out = run("generate", tmp_path / "data", "--path", checkpoints / "checkpoint_last.pt", "--beam", 5,
              "--cpu").stdout
    assert len([line for line in out.splitlines() if line.startswith("H-")]) == 13


def test_generate_nbest_and_sampling(trained):
    data, checkpoints, _ = trained
    path = checkpoints / "checkpoint_last.pt"
    nbest = run("generate", data, "--path", path, "--beam", 4, "--nbest", 3, "--max-sentences", 8,
                "--cpu").stdout
    hypotheses = [line for line in nbest.splitlines() if line.startswith("H-0\t")]
    assert len(hypotheses) == 3
    sampled = run("generate", data, "--path", path, "--sampling", "--sampling-topk", 5, "--beam", 2,
                  "--nbest", 2, "--seed", 3, "--max-sentences", 8, "--cpu").stdout
    assert len([line for line in sampled.splitlines() if line.startswith("H-0\t")]) == 2


def interactive(data, checkpoints, text):
    out = run("interactive", data, "--path", checkpoints / "checkpoint_last.pt", "--source-lang", "src",
              "--target-lang", "tgt", "--beam", 5, "--cpu", stdin=text).stdout
    return [line.split("\t")[2] for line in out.splitlines() if line.startswith("H-")]


def test_interactive_translates_stdin(trained):
    data, checkpoints, _ = trained
    hypotheses = interactive(data, checkpoints, "s1 s2 s3\ns4 s5 s6 s7\n")
    assert [len(h.split()) for h in hypotheses] == [3, 4]
    assert all(word.startswith("t") for h in hypotheses for word in h.split())


def printed_alignments(tool, data, checkpoints, cuda_graphs, stdin=""):
    """Each sentence's source, hypothesis and alignment (S, H, A lines, scores left out) of fairseq-generate
    or fairseq-interactive --print-alignment, the loop run eagerly or through the graphs' path (emulated on
    the CPU)."""
    out = run(tool, data, "--path", checkpoints / "checkpoint_last.pt", "--source-lang", "src", "--target-lang", "tgt",
              "--beam", 5, "--cpu", "--print-alignment", "--model-overrides", f"{{'cuda_graphs': '{cuda_graphs}'}}",
              stdin=stdin).stdout
    # a hypothesis's score differs by rounding between the two
    return [[kind, fields[-1]] for kind, *fields in (line.split("\t") for line in out.splitlines())
            if kind[:2] in ("S-", "H-", "A-")]


@pytest.mark.parametrize("tool, stdin", [("generate", ""), ("interactive", "s1 s2 s3\ns4 s5 s6 s7\n")])
def test_print_alignment_prints_the_same_alignments_eagerly_and_through_the_graphs(trained, tool, stdin):
    """fairseq's --print-alignment, as for its transformer: a source position for every target word."""
    data, checkpoints, _ = trained
    eager = printed_alignments(tool, data, checkpoints, "off", stdin)
    assert eager == printed_alignments(tool, data, checkpoints, "emulate", stdin)
    sentences = {}
    for kind, *fields in eager:
        sentences.setdefault(kind.split("-")[1], {})[kind[0]] = fields
    assert len(sentences) >= 2 and all(set(lines) == {"S", "H", "A"} for lines in sentences.values())
    for lines in sentences.values():
        source, target = lines["S"][-1].split(), lines["H"][-1].split()
        pairs = [tuple(map(int, pair.split("-"))) for pair in lines["A"][-1].split()]
        assert {t for _, t in pairs} == set(range(len(target)))
        assert all(s < len(source) for s, _ in pairs)


def test_hub_interface_translates_as_interactive_does(trained):
    data, checkpoints, _ = trained
    hub = FeedbackTransformerModel.from_pretrained(str(checkpoints), "checkpoint_last.pt", str(data))
    assert hub.translate(["s1 s2 s3", "s4 s5 s6 s7"], beam=5) == interactive(data, checkpoints, "s1 s2 s3\ns4 s5 s6 s7\n")


def test_training_resumes_from_checkpoint_last(trained, tmp_path):
    """Continued with the paper's dropout (of the attention weights and the
    feed-forward hidden layer), which the fused block runs."""
    data, checkpoints, _ = trained
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "checkpoint_last.pt").write_bytes((checkpoints / "checkpoint_last.pt").read_bytes())
    log = run("train", data, *TINY, "--max-update", 820, "--save-dir", resumed,
              "--attention-dropout", 0.1, "--activation-dropout", 0.1).stdout
    assert "@ 800 updates" in log  # loaded with its optimizer and progress
    assert last_number(r"num_updates (\d+)", log) == 820
    assert "step by step through autograd" not in log


def test_checkpoints_load_without_running_code_and_other_objects_are_refused(trained, tmp_path):
    _, checkpoints, _ = trained
    state = torch.load(checkpoints / "checkpoint_last.pt")  # weights_only, torch's default
    assert state["args"] is None or state["cfg"]["model"].arch == "feedback_transformer"

    class Payload:
        def __reduce__(self):
            return (print, ("this checkpoint ran code",))

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "extra": Payload()}, evil)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(evil)
    # the hub names it, without torch's advice to load it with weights_only=False (which would run it)
    with pytest.raises(FeedbackUsageError) as refused:
        FeedbackTransformerModel.from_pretrained(str(tmp_path), "evil.pt", str(trained[0]))
    # torch names the function as pickle wrote it: builtins.print (torch 2.6), print (later ones)
    assert re.match(rf"{re.escape(str(evil))} holds objects a fairseq checkpoint does not \((builtins\.)?print\)",
                    str(refused.value)), refused.value
    assert refused.value.__suppress_context__ and refused.value.__cause__ is None  # a traceback shows ours alone
    assert "weights_only" not in str(refused.value)


def last_line(proc):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode != 0
    return lines[-1]


def test_invalid_option_value_is_one_line_and_creates_nothing(trained, tmp_path):
    data, _, _ = trained
    proc = run("train", data, *TINY, "--memory-span", "0", "--save-dir", tmp_path / "never", check=False)
    assert last_line(proc) == "error: --memory-span must be at least 1, got 0"
    assert not (tmp_path / "never").exists()


def test_missing_dictionary_is_one_line(trained, tmp_path):
    data, checkpoints, _ = trained
    for f in data.iterdir():
        if f.name != "dict.tgt.txt":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    proc = run("generate", tmp_path, "--path", checkpoints / "checkpoint_last.pt", "--cpu", check=False)
    assert last_line(proc).startswith(f"error: dictionary {tmp_path}/dict.tgt.txt not found")


def test_checkpoint_with_another_dictionary_is_one_line(trained, tmp_path):
    _, checkpoints, _ = trained
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", tmp_path / "corpus", "--train", 50,
               "--vocab", 20)
    preprocess_translation(tmp_path / "corpus", tmp_path / "other")
    proc = run("generate", tmp_path / "other", "--path", checkpoints / "checkpoint_last.pt", "--cpu", check=False)
    assert "dictionary has" in last_line(proc) and "the model was trained with" in last_line(proc)


def test_sentence_longer_than_the_positions_is_one_line(trained):
    data, checkpoints, _ = trained
    proc = run("interactive", data, "--path", checkpoints / "checkpoint_last.pt", "--cpu",
               "--source-lang", "src", "--target-lang", "tgt", stdin=" ".join(["s1"] * 1100) + "\n", check=False)
    assert last_line(proc).startswith("error: Size of sample #0 is invalid (=(1101, 0))")


@pytest.mark.slow
def test_two_workers_train_to_the_parameters_of_one_worker_with_both_batches(tmp_path):
    """gloo on CPU, one process per rank: each worker takes 4 of the 8
    sentences per update, the single worker all 8."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [" ".join(f"s{(i * 7 + j) % 12}" for j in range(5)) for i in range(8)]
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.src").write_text("\n".join(lines) + "\n")
        (corpus / f"{split}.tgt").write_text("\n".join(l.replace("s", "t") for l in lines) + "\n")
    preprocess_translation(corpus, tmp_path / "data")
    # SGD: Adam would rescale the float noise of gradients that are zero in
    # exact arithmetic (attention key biases) into full-size steps
    common = [tmp_path / "data", *TRANSLATION_MODEL, "--optimizer", "sgd", "--lr", "0.5", "--required-batch-size-multiple", "1",
              "--max-update", "6", "--ddp-backend", "legacy_ddp"]

    run("train", *common, "--batch-size", 8, "--save-dir", tmp_path / "one")
    log = train_on_two_workers(*common, "--batch-size", 4, "--save-dir", tmp_path / "two")
    one = torch.load(tmp_path / "one" / "checkpoint_last.pt")["model"]
    two = torch.load(tmp_path / "two" / "checkpoint_last.pt")["model"]
    assert one.keys() == two.keys()
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=0)
    assert "training on 2 devices" in log and last_number(r"num_updates (\d+)", log) == 6
