"""WMT'14 English-German as fairseq's examples/translation/prepare-wmt14en2de.sh --icml17.

Train: Europarl v7 + Common Crawl + News Commentary v9 (WMT'14's; or v12,
WMT'17's, the script's default without --icml17: --news-commentary v12),
punctuation normalized, non-printing characters removed, Moses-tokenized with
aggressive hyphen splitting, joint BPE (32000 merges, as the paper) learnt on
train en+de, then clean-corpus-n (ratio 1.5, 1-250 tokens).  Valid =
newstest2013, where the paper tunes (fairseq's script takes every 100th train
pair instead), test = newstest2014 (the full set, as the script).
"""

import functools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep.arguments import log, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs, in_raw
from fairseq_feedback_cli.data_prep.text import parallel_segments, read_lines, tokenize, write_lines
from fairseq_feedback_cli.data_prep.translation import Corpus, JointBPE, prepare_translation, translation_parser

NAME = "wmt14_en_de"
SRC, TGT = "en", "de"
LANGS = (SRC, TGT)
EUROPARL, COMMONCRAWL = "training/europarl-v7.de-en", "commoncrawl.de-en"  # parallel files, without .en/.de
VALID = {lang: f"dev/newstest2013.{lang}" for lang in LANGS}
TEST = {SRC: f"test-full/newstest2014-deen-src.{SRC}.sgm", TGT: f"test-full/newstest2014-deen-ref.{TGT}.sgm"}


def _pair(prefix):
    return tuple(f"{prefix}.{lang}" for lang in LANGS)


def news_commentary(version):
    return f"training/news-commentary-{version}.de-en"


# WMT'14's own (prepare-wmt14en2de.sh --icml17), or WMT'17's (that script's default)
NEWS_COMMENTARY = {
    "v9": Archive("training-parallel-nc-v9.tgz", ("https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",),
                  "sha256:cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485",
                  _pair(news_commentary("v9"))),
    "v12": Archive("training-parallel-nc-v12.tgz",
                   ("https://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz",),
                   "sha256:2b45f30ef1d550d302fd17dd3a5cbe19134ccc4c2cf50c2dae534aee600101a2",
                   _pair(news_commentary("v12"))),
}
ARCHIVES = {
    a.filename: a for a in (
        Archive("training-parallel-europarl-v7.tgz",
                ("https://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",),
                "sha256:0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7",
                _pair(EUROPARL)),
        Archive("training-parallel-commoncrawl.tgz",
                ("https://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",),
                "sha256:c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5",
                _pair(COMMONCRAWL)),
        Archive("dev.tgz",
                ("https://data.statmt.org/wmt17/translation-task/dev.tgz",),
                "md5:9b1aa63c1cf49dccdd20b962fe313989",
                tuple(VALID.values())),
        Archive("test-full.tgz",
                ("https://statmt.org/wmt14/test-full.tgz",),
                "md5:a8cd784e006feb32ac6f3d9ec7eb389a",
                tuple(TEST.values())),
    )
}


def news_commentary_in(raw) -> list:
    """The News Commentary versions whose archive or files --raw holds."""
    return [v for v, archive in NEWS_COMMENTARY.items()
            if (raw / archive.filename).is_file() or in_raw(archive, raw) is not None]


def _train_lines(inputs: dict, lang: str, corpora):
    for prefix in corpora:
        yield from read_lines(inputs[f"{prefix}.{lang}"])


def make_text(out: Path, inputs: dict, workers: int, corpora) -> None:
    tests = parallel_segments({lang: [inputs[TEST[lang]]] for lang in LANGS})
    for lang in LANGS:
        kw = dict(lang=lang, aggressive=True)
        write_lines(out / f"train.{lang}", tokenize(_train_lines(inputs, lang, corpora), workers, f"train.{lang}",
                                                    normalize=True, **kw))
        write_lines(out / f"valid.{lang}", tokenize(read_lines(inputs[VALID[lang]]), workers, f"valid.{lang}",
                                                    normalize=True, **kw))
        # the recipe does not normalize the test set, only straightens ’
        write_lines(out / f"test.{lang}", tokenize(tests[lang], workers, f"test.{lang}",
                                                   quote=True, **kw))


def main(argv=None) -> None:
    parser = translation_parser(NAME, __doc__, default_merges=32000)
    parser.add_argument("--news-commentary", choices=sorted(NEWS_COMMENTARY),
                        help="v9: WMT'14's own (fairseq's prepare-wmt14en2de.sh --icml17); v12: WMT'17's (that "
                             "script's default). Default: the one --raw holds, else v9")
    args = parser.parse_args(argv)
    resolve_dirs(args)
    version = args.news_commentary
    if version is None:
        found = news_commentary_in(args.raw) if args.raw is not None else []
        if len(found) > 1:
            fail(f"{args.raw} holds News Commentary {' and '.join(found)}: pick one with --news-commentary")
        version = found[0] if found else "v9"
    news = NEWS_COMMENTARY[version]
    log(f"train: Europarl v7, Common Crawl and News Commentary {version} ({news.filename}; "
        + ("WMT'14's own, as fairseq's prepare-wmt14en2de.sh --icml17)" if version == "v9"
           else "WMT'17's, as fairseq's prepare-wmt14en2de.sh without --icml17)"))
    corpora = (EUROPARL, COMMONCRAWL, news_commentary(version))
    archives = [*ARCHIVES.values(), news]
    prepare_translation(args, Corpus(
        NAME, LANGS, {"dataset": NAME, "news_commentary": version, "sources": describe_sources(archives, args.raw)},
        inputs=lambda: gather_inputs(archives, args.raw, args.work),
        make_text=functools.partial(make_text, corpora=corpora),
        # the recipe cleans after BPE, so the 250 limit counts subwords
        subwords=JointBPE(args.bpe_merges, clean=(1, 250, 1.5))))


if __name__ == "__main__":
    run_cli(main)
