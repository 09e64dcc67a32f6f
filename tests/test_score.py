"""feedback-score: BLEU and ROUGE of fairseq-generate output, as the paper reports them."""

import re
from pathlib import Path

import pytest
from helpers import assert_one_error_line, error_of, run_as_a_user

from fairseq_feedback_cli import score as score_module


def score(*argv):
    score_module.main([str(a) for a in argv])


def test_compound_splitting_matches_fairseqs_perl_one_liner():
    # expected: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g', as scripts/compound_split_bleu.sh
    cases = {
        "a-b": "a ##AT##-##AT## b",
        "a-b-c": "a ##AT##-##AT## b-c",
        "well-known x - y --z a--b 3-4-5-6": "well ##AT##-##AT## known x - y - ##AT##-##AT## z "
                                             "a ##AT##-##AT## -b 3 ##AT##-##AT## 4-5 ##AT##-##AT## 6",
        "gut @-@ bekanntes": "gut @ ##AT##-##AT## @ bekanntes",
        "no hyphen -": "no hyphen -",
    }
    for line, expected in cases.items():
        assert score_module.compound_split(line) == expected


def generate_output(path: Path, pairs, order=None):
    lines = []
    for i in order or range(len(pairs)):
        hyp, ref = pairs[i]
        lines += [f"S-{i}\tsource {i}", f"T-{i}\t{ref}", f"H-{i}\t-0.5\t{hyp}", f"D-{i}\t-0.5\t{hyp}",
                  f"P-{i}\t-0.1 -0.2"]
    path.write_text("\n".join(lines + ["Generate test with beam=5: BLEU4 = 0.00"]) + "\n")
    return path


def test_bleu_tokenized_and_compound_split(tmp_path, capsys):
    import sacrebleu

    pairs = [("the well-known cat sat on the mat .", "the well-known cat sat on a mat ."),
             ("a state-of-the-art model works", "a state-of-the-art model works well")]
    gen = generate_output(tmp_path / "gen.out", pairs, order=[1, 0])
    score("--metric", "bleu", "--gen", gen, "--quiet")
    tokenized = float(capsys.readouterr().out)
    expected = sacrebleu.corpus_bleu([h for h, _ in pairs], [[r for _, r in pairs]], tokenize="none",
                                     smooth_method="none").score
    assert tokenized == pytest.approx(expected, abs=0.006)
    score("--metric", "bleu-compound-split", "--gen", gen)
    out = capsys.readouterr().out
    split = [(h.replace("well-known", "well ##AT##-##AT## known").replace(
        "state-of-the-art", "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"), r) for h, r in pairs]
    split = [(h, r.replace("well-known", "well ##AT##-##AT## known").replace(
        "state-of-the-art", "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art")) for h, r in split]
    expected = sacrebleu.corpus_bleu([h for h, _ in split], [[r for _, r in split]], tokenize="none",
                                     smooth_method="none").score
    assert float(re.search(r"BLEU = ([\d.]+)", out).group(1)) == pytest.approx(expected, abs=0.006)
    assert "compound splitting of 2 sentences" in out and "tok:none" in out


def test_tokenized_bleu_is_fairseqs_bleu4(tmp_path, capsys):
    """The number fairseq-generate and fairseq-score print for tokenized text."""
    import random

    from fairseq.data import Dictionary
    from fairseq.scoring.bleu import BleuConfig, Scorer

    rng = random.Random(0)
    words = "the a cat dog sat on mat house is small big red green".split()
    pairs = []
    for _ in range(50):
        ref = [rng.choice(words) for _ in range(rng.randint(5, 15))]
        hyp = [w if rng.random() < 0.7 else rng.choice(words) for w in ref][: len(ref) - rng.randint(0, 2)]
        pairs.append((" ".join(hyp), " ".join(ref)))
    d = Dictionary()
    fairseq_bleu = Scorer(BleuConfig(pad=d.pad(), eos=d.eos(), unk=d.unk()))
    for hyp, ref in pairs:
        fairseq_bleu.add(d.encode_line(ref, add_if_not_exist=True), d.encode_line(hyp, add_if_not_exist=True))
    score("--metric", "bleu", "--gen", generate_output(tmp_path / "gen.out", pairs), "--quiet")
    assert float(capsys.readouterr().out) == pytest.approx(fairseq_bleu.score(), abs=0.006)


def test_sacrebleu_detokenizes_and_reads_sgm_references(tmp_path, capsys):
    gen = generate_output(tmp_path / "gen.out", [("Ein gut @-@ bekanntes Buch &quot; hier &quot; .", "x"),
                                                 ("Es ist 3.5 % .", "y")])
    sgm = tmp_path / "ref.sgm"
    sgm.write_text('<refset setid="t" srclang="any" trglang="de">\n<doc sysid="ref" docid="1">\n'
                   '<seg id="1">Ein gut-bekanntes Buch "hier".</seg>\n<seg id="2">  Es ist 3.5%. </seg>\n'
                   "</doc>\n</refset>\n")
    score("--metric", "sacrebleu", "--gen", gen, "--detokenize", "de", "--ref", sgm)
    out = capsys.readouterr().out
    assert out.startswith("BLEU = 100.00") and "tok:13a" in out
    # without --ref, the T- lines are detokenized as the hypotheses are
    tokenized = [("Ein gut @-@ bekanntes Buch &quot; hier &quot; .",) * 2, ("Es ist 3.5 % .",) * 2]
    score("--metric", "sacrebleu", "--gen", generate_output(tmp_path / "t.out", tokenized), "--detokenize", "de")
    assert capsys.readouterr().out.startswith("BLEU = 100.00")


@pytest.mark.parametrize("metric", ["bleu", "sacrebleu", "rouge"])
def test_text_equal_to_its_reference_but_for_a_byte_order_mark_scores_100(tmp_path, capsys, metric):
    """A byte-order mark (Windows editors write one) is no letter of the first word: identical text
    scored 83.8 with one, on either side, read from --hyp, --gen or --ref."""
    lines = ["the cat sat on the mat .", "a dog ran .", "it rained ."]
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    marked.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
    gen = generate_output(tmp_path / "gen.out", [(line, line) for line in lines])
    gen.write_bytes(b"\xef\xbb\xbf" + gen.read_bytes())
    for hyp, ref in ((marked, plain), (plain, marked)):
        score("--metric", metric, "--hyp", hyp, "--ref", ref, "--quiet")
        assert float(capsys.readouterr().out) == 100
    score("--metric", metric, "--gen", gen, "--ref", marked, "--quiet")
    assert float(capsys.readouterr().out) == 100


@pytest.mark.parametrize("broken", ['<seg id="2">Es ist 3.5%.', 'Es ist 3.5%.</seg>',
                                    '<seg id="2">Es ist</seg> <seg id="3">3.5%.</seg>'],
                         ids=["a seg not closed", "a seg not opened", "two segs on a line"])
def test_a_reference_test_set_line_that_is_not_one_whole_seg_is_named(tmp_path, broken):
    """Such a line blanked a reference (or shifted every one after it), and the score went on with exit 0."""
    sgm = tmp_path / "ref.sgm"
    sgm.write_text('<refset setid="t" srclang="any" trglang="de">\n<doc sysid="ref" docid="1">\n'
                   f'<seg id="1">Ein Buch.</seg>\n{broken}\n<seg id="4">Ja.</seg>\n</doc>\n</refset>\n')
    gen = generate_output(tmp_path / "gen.out", [("Ein Buch .", "x"), ("Es ist 3.5 % .", "y"), ("Ja .", "z")])
    message = error_of(score, "--metric", "sacrebleu", "--gen", gen, "--ref", sgm)
    assert message.startswith(f"error: {sgm}, line 4: not one whole <seg>...</seg>")


def test_rouge_of_a_known_pair(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat.\n")
    ref.write_text("the cat is on the mat.\n")
    score("--metric", "rouge", "--hyp", hyp, "--ref", ref)
    out = capsys.readouterr().out
    # unigrams: 5 of 6 either way; bigrams: the cat, on the, the mat = 3 of 5; LCS: the cat on the mat
    assert "ROUGE-1 = 83.33  ROUGE-2 = 60.00  ROUGE-L = 83.33" in out
    # two sentences against one: summary-level ROUGE-L takes the union of the LCS of each
    hyp.write_text("the cat sat. on the mat.\n")
    score("--metric", "rouge", "--hyp", hyp, "--ref", ref, "--quiet")
    assert float(capsys.readouterr().out) == pytest.approx(83.33, abs=0.01)


def test_several_outputs_are_ranked_best_first(tmp_path, capsys):
    good = generate_output(tmp_path / "1.0", [("a b c d e", "a b c d e"), ("f g h i", "f g h i")])
    bad = generate_output(tmp_path / "0.6", [("a b c x e", "a b c d e"), ("f g h i", "f g h i")])
    score("--metric", "bleu", "--gen", bad, good)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[1] for line in lines] == [str(good), str(bad)]
    assert float(lines[0].split("\t")[0]) == 100.0 > float(lines[1].split("\t")[0])


def cut(path: Path, lines: int) -> Path:
    """What a fairseq-generate run killed after writing `lines` lines leaves."""
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:lines]))
    return path


def test_an_output_cut_short_is_refused_unless_a_subset_is_asked_for(tmp_path, capsys):
    pairs = [("a b c d", "a b c d"), ("e f g h", "e f x h"), ("i j k l", "i j k l")]
    gen = cut(generate_output(tmp_path / "gen.out", pairs, order=[1, 2, 0]), 10)  # sentences 1 and 2 only
    message = error_of(score, "--metric", "bleu", "--gen", gen)
    assert "closing line" in message and "--allow-subset" in message
    score("--metric", "bleu", "--gen", gen, "--allow-subset")
    captured = capsys.readouterr()
    assert "of 2 sentences" in captured.out and "scoring the 2 sentences it has, of 3 or more" in captured.err
    # and in a tuning run: the half-written output is not ranked first, the run stops naming it
    complete = generate_output(tmp_path / "complete.out", [("a b c d", "a b c d"), ("e f g h", "e f x h"),
                                                           ("i j k l", "i j k x")])
    assert str(gen) in error_of(score, "--metric", "bleu", "--gen", complete, gen)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("references", [True, False], ids=["with references", "without"])
def test_two_outputs_concatenated_are_refused_not_scored_as_one(tmp_path, references):
    """Two runs' outputs in one file (every id twice) were scored as one run, the second taken for n-best entries."""
    first = generate_output(tmp_path / "a.out", [("a b c d", "a b c d"), ("e f g h", "e f g h")])
    second = generate_output(tmp_path / "b.out", [("a b x d", "a b c d"), ("e f g h", "e f g h")])
    both = tmp_path / "both.out"
    both.write_text("".join(line for path in (first, second) for line in path.read_text().splitlines(True)
                            if references or not line.startswith("T-")))
    assert "more than one fairseq-generate" in error_of(score, "--metric", "bleu", "--gen", both)


def test_sentences_fairseq_left_out_are_named(tmp_path, capsys):
    pairs = [("a b c d", "a b c d")] * 4
    gen = generate_output(tmp_path / "gen.out", pairs, order=[0, 1, 3])  # a batch dropped: sentence 2
    assert "none for sentences 2" in error_of(score, "--metric", "bleu", "--gen", gen)
    # the split's size, as fairseq logs it when loading the split (in its format, or Python's when fairseq's
    # logging set-up came too late), reveals a missing last sentence too
    for log_line in ("2024-01-01 00:00:00 | INFO | fairseq.tasks.translation | data-bin/x test de-en 5 examples",
                     "INFO:fairseq.tasks.translation:data-bin/x test de-en 5 examples"):
        logged = tmp_path / "logged.out"
        logged.write_text(log_line + "\n" + generate_output(tmp_path / "all4.out", pairs).read_text())
        message = error_of(score, "--metric", "bleu", "--gen", logged)
        assert "the split has 5 sentences (none for sentences 4)" in message and "--required-batch-size" in message
        score("--metric", "bleu", "--gen", logged, "--allow-subset", "--quiet")
        assert capsys.readouterr().out.strip() == "100.00"


def test_score_errors_are_one_line(tmp_path):
    gen = generate_output(tmp_path / "gen.out", [("a b", "a b"), ("c d", "c d")])
    three = tmp_path / "three.txt"
    three.write_text("a b\nc d\ne f\n")
    assert "not found" in error_of(score, "--metric", "bleu", "--gen", tmp_path / "missing.out")
    assert "has 2 hypotheses but" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", three)
    assert "--required-batch-size-multiple 1" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", three)
    one = tmp_path / "one.txt"
    one.write_text("a b\n")
    assert "has 3 lines but" in error_of(score, "--metric", "rouge", "--hyp", three, "--ref", one)
    assert "needs --ref" in error_of(score, "--metric", "bleu", "--hyp", three)
    assert "no hypotheses" in error_of(score, "--metric", "bleu", "--gen", three)
    assert "invalid choice" in error_of(score, "--metric", "meteor", "--gen", gen)
    assert "only 1 lines" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", one)
    no_targets = tmp_path / "no-targets.out"
    no_targets.write_text("H-0\t-1\ta b\n")
    assert "no references" in error_of(score, "--metric", "bleu", "--gen", no_targets)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in error_of(score, "--metric", "bleu", "--hyp", tmp_path / "latin1.txt", "--ref", one)
    # sacremoses detokenized by no language's rules, without a word, for a code it does not know: a BLEU all the same
    assert error_of(score, "--metric", "sacrebleu", "--gen", gen, "--detokenize", "xx").startswith(
        "error: --detokenize xx is not a language Moses knows: pass the code of the hypotheses' language, one of as, "
        "bn, ca, cs, de, el, en, ")


@pytest.mark.slow
def test_a_command_line_error_is_one_line_without_traceback(tmp_path):
    assert_one_error_line(run_as_a_user("fairseq_feedback_cli.score", "--metric", "bleu", "--gen", "missing.out",
                                        cwd=tmp_path))
