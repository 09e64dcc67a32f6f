"""feedback-score: BLEU and ROUGE of fairseq-generate output, as the paper reports them.

    feedback-score --metric bleu-compound-split --gen gen.out      # WMT: the paper's metric
    feedback-score --metric sacrebleu --gen gen.out --detokenize de --ref newstest2014-deen-ref.de.sgm
    feedback-score --metric bleu --gen gen.out                     # IWSLT: tokenized BLEU
    feedback-score --metric rouge --gen gen.out --ref test.target  # CNN-DailyMail

Hypotheses come from fairseq-generate's output (--gen: its `H-<id>` lines, in
sentence order; the first of each id when it printed an n-best list) or from
a file of one hypothesis per line (--hyp). References come from --ref (one per
line, or the `<seg>` lines of an .sgm/.xml test set), or else from the `T-<id>`
lines of --gen.

Metrics:
  bleu                 tokenized BLEU: the hypotheses and references as they
                       are (tokenized), split on spaces (sacrebleu with
                       tokenize='none', no smoothing): what fairseq-score and
                       multi-bleu.perl compute.
  bleu-compound-split  tokenized BLEU after splitting hyphenated compounds,
                       `a-b` -> `a ##AT##-##AT## b`, on both sides, exactly as
                       fairseq's scripts/compound_split_bleu.sh (perl
                       s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g): the WMT'14 en-de
                       number of Vaswani et al., Ott et al. and the paper.
  sacrebleu            sacreBLEU (13a tokenization) of detokenized text; pass
                       --detokenize LANG to Moses-detokenize tokenized
                       hypotheses (as fairseq's scripts/sacrebleu.sh), and the
                       raw reference as --ref (without --ref, the T- lines are
                       detokenized too: close to, not the same as, the raw
                       reference).
  rouge                ROUGE-1, ROUGE-2 and ROUGE-L F1 (x100, averaged over the
                       summaries) by Google's rouge-score with Porter stemming;
                       ROUGE-L is summary-level (rougeLsum) over sentences split
                       after . ! or ?, as ROUGE-1.5.5 scores multi-sentence
                       summaries; the sentence-level rougeL is printed beside it.

A score covers the whole test set unless it says otherwise. A --gen file must
show that fairseq-generate finished (its closing line, `Generate <split> with
beam=...`, printed after the last sentence) and hold a hypothesis for every
sentence of the split: ids 0..N-1, N being the lines of --ref, else the
split's size that fairseq logs when it loads it, else the largest id + 1.
Otherwise (a run that was killed or cut short, sentences fairseq-generate
left out) the command stops and names what is missing; --allow-subset scores
the sentences there are instead, and says how many of how many.

--quiet prints the main number alone (BLEU, or ROUGE-L). Several --gen files
(a tuning run: one output per setting) print one line each, "SCORE<TAB>FILE",
best first, so `head -1` names the best setting.
Mistakes (a missing file, no hypotheses, line counts that differ, an
incomplete output) end with one line, never a traceback.
"""

import argparse
import re
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .command_line import ArgumentParser, command, fail
from .sgm import segments

METRICS = ("bleu", "bleu-compound-split", "sacrebleu", "rouge")
_COMPOUND = re.compile(r"(\S)-(\S)")
_GEN_LINE = re.compile(r"([HT])-(\d+)\t(.*)")
_CLOSING_LINE = re.compile(r"Generate \S+ with beam=\d+: ")
# fairseq's translation task logs "{data} {split} {src}-{tgt} {N} examples" as it loads the split (into
# the output when its logging goes there: fairseq's format "... | fairseq.tasks.translation | ...", or Python's)
_SPLIT_SIZE = re.compile(r"fairseq\.tasks\.translation\W.* (\S+) \S+-\S+ (\d+) examples$")
_REGENERATE = ("rerun fairseq-generate with --required-batch-size-multiple 1 (without it fairseq drops a last "
               "batch smaller than 8) and without --skip-invalid-size-inputs-valid-test")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=\S)")


def compound_split(line: str) -> str:
    """fairseq's compound_split_bleu.sh: non-overlapping, left to right, as perl's s///g."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


def read_text(path: str) -> List[str]:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8", newline="\n") as f:
                text = f.read()
    except FileNotFoundError:
        fail(f"{path} not found")
    except IsADirectoryError:
        fail(f"{path} is a folder, not a file")
    except UnicodeDecodeError as e:
        fail(f"{path} is not UTF-8 text (byte {e.start})")
    except OSError as e:
        fail(f"cannot read {path} ({e.strerror or e})")
    # a byte-order mark (Windows editors write one) is no part of the first line's text: sacrebleu
    # would read it as a letter of the first word, and score text equal to its reference below 100
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def read_references(path: str) -> List[str]:
    """One reference a line, or the <seg> lines of an .sgm/.xml test set (as sacrebleu reads them)."""
    lines = read_text(path)
    if path.lower().endswith((".sgm", ".xml")):
        lines = segments(lines, path)
        if not lines:
            fail(f"{path} has no <seg> lines: is it an .sgm test set?")
    return lines


@dataclass
class GenerateOutput:
    hypotheses: Dict[int, str]  # the first H line of each id
    references: Dict[int, str]  # T lines
    finished: bool  # it holds fairseq-generate's closing line
    split_size: Optional[int]  # sentences in the split, as fairseq logged when loading it


def read_generate_output(path: str) -> GenerateOutput:
    """Its hypotheses (the first of an n-best list) and references; one run's
    output only: two concatenated would be scored as one (an id's second
    sentence taken for an n-best entry)."""
    hyps, refs, finished, split_files = {}, {}, False, {}
    for line in read_text(path):
        m = _GEN_LINE.match(line)
        if not m:
            if _CLOSING_LINE.search(line) and finished:
                fail(f"{path} holds the end of more than one fairseq-generate run: score each run's output apart")
            finished = finished or bool(_CLOSING_LINE.search(line))
            size = _SPLIT_SIZE.search(line)
            if size:  # a split in several files (test, test1, ...) is logged once per file
                split_files[size.group(1)] = int(size.group(2))
            continue
        kind, sid, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "H":
            parts = rest.split("\t", 1)  # score, then the text (empty for an empty hypothesis)
            if sid not in hyps:
                hyps[sid] = parts[1] if len(parts) > 1 else ""
        elif sid in refs:
            fail(f"{path} holds the reference of sentence {sid} twice (T-{sid}): it is more than one "
                 "fairseq-generate output; score each run's output apart")
        else:
            refs[sid] = rest
    if not hyps:
        fail(f"{path} holds no hypotheses (H-<id> lines): pass fairseq-generate's output, "
             "or a file of one hypothesis a line as --hyp")
    return GenerateOutput(hyps, refs, finished, sum(split_files.values()) if split_files else None)


def _ids(ids) -> str:
    ids = sorted(ids)
    return ", ".join(map(str, ids[:5])) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")


def pairs(args, gen: Optional[str]) -> Tuple[List[str], List[str]]:
    """Hypotheses and references, aligned: of every sentence, or with --allow-subset of those there are."""
    if gen is None:
        if args.ref is None:
            fail("--hyp needs --ref (the references, one a line)")
        hyps, refs = read_text(args.hyp), read_references(args.ref)
        if len(hyps) != len(refs):
            fail(f"{args.hyp} has {len(hyps)} lines but {args.ref} has {len(refs)}: they must align line by line")
        return hyps, refs
    out = read_generate_output(gen)
    if args.ref is not None:
        references = dict(enumerate(read_references(args.ref)))
        beyond = {i for i in out.hypotheses if i not in references}
        if beyond:
            fail(f"{gen} has hypotheses for sentences {_ids(beyond)} but {args.ref} has only "
                 f"{len(references)} lines: is it the reference of the generated split?")
        split, expected = len(references), f"{args.ref} has {len(references)} lines"
    else:
        if not out.references:
            fail(f"{gen} has no references (T-<id> lines): pass them as --ref")
        references = out.references
        split = out.split_size or max(out.hypotheses) + 1
        expected = (f"the split has {split} sentences" if out.split_size
                    else f"its sentence ids run to {split - 1}")
    ids = sorted(set(out.hypotheses) & set(references))
    missing = set(range(split)) - set(ids)
    subset = f"or pass --allow-subset to score the {len(ids)} sentences it has"
    if not args.allow_subset:
        if not out.finished:
            fail(f"{gen} lacks fairseq-generate's closing line ('Generate <split> with beam=...'): the run did not "
                 f"finish (killed, cut short or still running), so sentences may be missing; rerun it, {subset}")
        if missing:
            fail(f"{gen} has {len(ids)} hypotheses but {expected} (none for sentences {_ids(missing)}): "
                 f"fairseq-generate left them out; {_REGENERATE}, {subset}")
    elif missing or not out.finished:
        print(f"note: {gen}: scoring the {len(ids)} sentences it has, of {split}"
              + ("" if out.finished else " or more (the run did not finish)") + " (--allow-subset)", file=sys.stderr)
    return [out.hypotheses[i] for i in ids], [references[i] for i in ids]


def check_language(lang: str) -> None:
    """--detokenize LANG, a language Moses knows: sacremoses takes any code, and detokenized by no
    language's rules, without a word, a mistyped one (`xx`: a BLEU all the same)."""
    try:
        from sacremoses.corpus import NonbreakingPrefixes
    except ImportError:
        fail("--detokenize needs sacremoses: pip install sacremoses")
    # the languages Moses has data for (its non-breaking prefixes), and Korean, which its detokenizer names
    known = set(NonbreakingPrefixes().available_langs.values()) | {"ko"}
    if lang not in known:
        fail(f"--detokenize {lang} is not a language Moses knows: pass the code of the hypotheses' language, one of "
             f"{', '.join(sorted(known))}")


def detokenize(lines: List[str], lang: str) -> List[str]:
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def bleu(hyps: List[str], refs: List[str], tokenized: bool):
    from sacrebleu.metrics import BLEU

    metric = BLEU(tokenize="none", smooth_method="none", force=True) if tokenized else BLEU()
    return metric.corpus_score(hyps, [refs]), metric.get_signature()


def split_sentences(text: str) -> str:
    return "\n".join(_SENTENCE_END.split(text.strip()))


def rouge(hyps: List[str], refs: List[str]) -> Dict[str, float]:
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        fail("--metric rouge needs Google's rouge-score: pip install rouge-score")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=True)
    totals = dict.fromkeys(("rouge1", "rouge2", "rougeL", "rougeLsum"), 0.0)
    for hyp, ref in zip(hyps, refs):
        scores = scorer.score(split_sentences(ref), split_sentences(hyp))  # (target, prediction)
        for key in totals:
            totals[key] += scores[key].fmeasure
    return {key: 100 * total / max(1, len(hyps)) for key, total in totals.items()}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="feedback-score", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metric", required=True, choices=METRICS)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gen", metavar="FILE", nargs="+",
                        help="fairseq-generate output ('-': standard input); several files: rank them")
    source.add_argument("--hyp", metavar="FILE", help="hypotheses, one a line")
    p.add_argument("--ref", metavar="FILE", help="references, one a line, or an .sgm/.xml test set "
                                                "(default with --gen: its T- lines)")
    p.add_argument("--detokenize", metavar="LANG",
                   help="Moses-detokenize the hypotheses first (and T- line references), for sacrebleu")
    p.add_argument("--quiet", action="store_true", help="print the main number only")
    p.add_argument("--allow-subset", action="store_true",
                   help="score the sentences a --gen file has even if some are missing or the run was cut short "
                        "(a note says how many of how many); without it, that is an error")
    return p


def evaluate(args, gen: Optional[str]):
    """(the main number, the lines to print) for one output."""
    hyps, refs = pairs(args, gen)
    if not hyps:
        fail("no sentences to score")
    if args.detokenize:
        hyps = detokenize(hyps, args.detokenize)
        if args.ref is None:  # the T- lines are as tokenized as the hypotheses
            refs = detokenize(refs, args.detokenize)
    n = len(hyps)
    if args.metric == "rouge":
        from importlib.metadata import version

        r = rouge(hyps, refs)
        return r["rougeLsum"], [
            f"ROUGE-1 = {r['rouge1']:.2f}  ROUGE-2 = {r['rouge2']:.2f}  ROUGE-L = {r['rougeLsum']:.2f}",
            f"F1 x 100 over {n} summaries; rouge-score {version('rouge-score')}, Porter stemmer; "
            f"ROUGE-L summary-level (rougeLsum), sentence-level rougeL = {r['rougeL']:.2f}",
        ]
    if args.metric == "bleu-compound-split":
        hyps, refs = [compound_split(h) for h in hyps], [compound_split(r) for r in refs]
    score, signature = bleu(hyps, refs, tokenized=args.metric != "sacrebleu")
    what = {"bleu": "tokenized BLEU", "bleu-compound-split": "tokenized BLEU with compound splitting",
            "sacrebleu": "sacreBLEU"}[args.metric]
    return score.score, [str(score), f"{what} of {n} sentences; sacrebleu {signature}"]


@command
def main(argv: Optional[List[str]] = None) -> None:
    args = parser().parse_args(argv)
    if args.detokenize is not None:
        check_language(args.detokenize)
    if args.gen is not None and len(args.gen) > 1:
        if "-" in args.gen:
            fail("standard input ('-') can only be the one --gen")
        ranked = sorted(((evaluate(args, gen)[0], gen) for gen in args.gen), key=lambda x: -x[0])
        for score, gen in ranked:
            print(f"{score:.2f}\t{gen}")
        return
    score, lines = evaluate(args, args.gen[0] if args.gen else None)
    print(f"{score:.2f}" if args.quiet else "\n".join(lines))


if __name__ == "__main__":
    main()
