"""CNN-DailyMail summarization (non-anonymized), split by See et al.'s url lists.

Input: the story files (cnn_stories.tgz, dailymail_stories.tgz and the url
lists all_{train,val,test}.txt of abisee/cnn-dailymail; a story is named by
the sha1 of its url), or ready line files {train,val,test}.{source,target}
(one article / summary per line) in --raw.  As See et al.: a period is added
to lines missing one, the article is cut to its first 400 words, the
highlights joined make the summary; train pairs with an empty side are
dropped.  A joint sentencepiece BPE model is learnt on train source+target.
The detokenized test summaries stay in <work>/text/test.target for ROUGE.
"""

import functools
import hashlib
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.common import (Archive, binarize, count_lines, describe_sources, dest_is_done, fail, gather_inputs,
                              identity, log, log_counts, make_parser, pmap, read_lines, read_pairs, resolve_dirs,
                              run_cli, step)

NAME = "cnn_dm"
SPLITS = {"train": "train", "valid": "val", "test": "test"}  # ours -> the url lists' / line files' names
SIDES = ("source", "target")
ARTICLE_WORDS = 400
SPM_MODEL = "sentencepiece.bpe.model"
# acceptable sentence ends, as See et al.'s make_datafiles.py
END_TOKENS = (".", "!", "?", "...", "'", "`", '"', "\u2019", "\u201d", ")")


def _drive(file_id):
    # Google Drive asks large downloads to confirm; confirm=t skips that page
    return (f"https://drive.usercontent.google.com/download?id={file_id}&export=download&confirm=t",
            f"https://drive.google.com/uc?export=download&id={file_id}&confirm=t")


def _url_list(name, checksum):
    return Archive(name, (f"https://raw.githubusercontent.com/abisee/cnn-dailymail/master/url_lists/{name}",),
                   checksum, (f"url_lists/{name}",), plain=True)


ARCHIVES = {
    a.filename: a for a in (
        Archive("cnn_stories.tgz", _drive("0BwmD_VLjROrfTHk4NFg2SndKcjQ"),
                "sha256:e8fbc0027e54e0a916abd9c969eb35f708ed1467d7ef4e3b17a56739d65cb200", ("cnn/stories/",)),
        Archive("dailymail_stories.tgz", _drive("0BwmD_VLjROrfM1BxdkxVaTY2bWs"),
                "sha256:ad69010002210b7c406718248ee66e65868b9f6820f163aa966369878d14147e", ("dailymail/stories/",)),
        _url_list("all_train.txt", "sha256:a5cee49f3a6c862c26ce29308236d2a99625ab6c86a43be22d5206b2790d8029"),
        _url_list("all_val.txt", "sha256:81887e982b045083409c6ee838aede8ff4b97291605bcfb21bffc456a16991db"),
        _url_list("all_test.txt", "sha256:c4f5efb5ec2126430a5c156efbd13d0e9c4cb490169e552c38b4a51981a009bd"),
    )
}


def _fix_missing_period(line: str) -> str:
    # image captions often lack a period and would run into the next sentence
    return line if line.endswith(END_TOKENS) else line + "."


def read_story(path: Path) -> tuple:
    """(article, summary) of a .story file: text lines, then "@highlight" lines each before a highlight."""
    article, highlights, in_highlights = [], [], False
    for line in read_lines(path):
        line = line.strip()
        if not line:
            continue
        if line.startswith("@highlight"):
            in_highlights = True
        else:
            (highlights if in_highlights else article).append(_fix_missing_period(line))
    return " ".join(article), " ".join(highlights)


def truncate(article: str) -> str:
    return " ".join(article.split()[:ARTICLE_WORDS])


def _story_path(url: str, story_dirs) -> Path:
    name = hashlib.sha1(url.encode("utf-8")).hexdigest() + ".story"
    for d in story_dirs:
        if (d / name).is_file():
            return d / name
    fail(f"story {name} (for {url}) is in neither {' nor '.join(map(str, story_dirs))}")


def text_from_stories(out: Path, files: dict, workers: int) -> None:
    story_dirs = [files["cnn/stories/"], files["dailymail/stories/"]]
    for split, theirs in SPLITS.items():
        urls = [u.strip() for u in read_lines(files[f"url_lists/all_{theirs}.txt"]) if u.strip()]
        paths = [_story_path(u, story_dirs) for u in urls]
        pairs = pmap(read_story, paths, workers, f"read {split} stories", total=len(paths))
        write_pairs(out, split, pairs)


def text_from_lines(out: Path, raw: Path) -> None:
    for split, theirs in SPLITS.items():
        pairs = read_pairs(raw / f"{theirs}.source", raw / f"{theirs}.target")
        write_pairs(out, split, pairs)


def write_pairs(out: Path, split: str, pairs) -> None:
    n = kept = 0
    with open(out / f"{split}.source", "w", encoding="utf-8") as fs, \
            open(out / f"{split}.target", "w", encoding="utf-8") as ft:
        for article, summary in pairs:
            n += 1
            article, summary = truncate(article), " ".join(summary.split())
            # empty articles (a hundred or so stories) teach nothing; valid and
            # test keep them so they stay the standard sets
            if split == "train" and not (article and summary):
                continue
            kept += 1
            fs.write(article + "\n")
            ft.write(summary + "\n")
    log(f"{split}: {kept} of {n} pairs")


def make_spm(out: Path, text: Path, vocab_size: int, workers: int) -> None:
    import sentencepiece as spm

    prefix = out / SPM_MODEL.rsplit(".", 1)[0]
    log(f"training a {vocab_size} piece sentencepiece BPE model ...")
    with open(out / "spm_train.log", "w") as logfile:
        spm.SentencePieceTrainer.train(
            input=",".join(str(text / f"train.{side}") for side in SIDES), model_prefix=str(prefix),
            model_type="bpe", vocab_size=vocab_size, num_threads=workers,
            input_sentence_size=1_000_000, shuffle_input_sentence=True, max_sentence_length=1 << 16,
            hard_vocab_limit=False,  # a soft limit, so small corpora (tests) work too
            logstream=logfile)
    sp = spm.SentencePieceProcessor(model_file=str(out / SPM_MODEL))
    for split in SPLITS:
        for side in SIDES:
            lines = read_lines(text / f"{split}.{side}")
            with open(out / f"{split}.{side}", "w", encoding="utf-8") as f:
                while batch := list(itertools.islice(lines, 10000)):
                    for pieces in sp.encode(batch, out_type=str, num_threads=workers):
                        f.write(" ".join(pieces) + "\n")


def main(argv=None) -> None:
    parser = make_parser(NAME, __doc__)
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="sentencepiece BPE vocabulary size (default: %(default)s)")
    args = parser.parse_args(argv)
    resolve_dirs(args)
    line_files = [f"{theirs}.{side}" for theirs in SPLITS.values() for side in SIDES]
    from_lines = args.raw is not None and any((args.raw / f).exists() for f in line_files)
    if from_lines:
        missing = [f for f in line_files if not (args.raw / f).is_file()]
        if missing:
            fail(f"{args.raw} has some line files but not {missing[0]}")
        sources = {f: identity(args.raw / f) for f in line_files}
    else:
        sources = describe_sources(list(ARCHIVES.values()), args.raw)
    made_from = {"dataset": NAME, "input": "line files" if from_lines else "stories", "sources": sources}
    settings = {**made_from, "vocab_size": args.vocab_size}
    if dest_is_done(args.dest, settings):
        return
    if from_lines:
        build = functools.partial(text_from_lines, raw=args.raw)
    else:
        files = gather_inputs(list(ARCHIVES.values()), args.raw, args.work)
        build = functools.partial(text_from_stories, files=files, workers=args.workers)
    text = step(args.work / "text", build, made_from)
    log(f"detokenized test summaries (ROUGE references): {text / 'test.target'}")
    pieces = step(args.work / "spm", functools.partial(make_spm, text=text, vocab_size=args.vocab_size,
                                                       workers=args.workers), settings)
    binarize(args.dest, settings,
             ["--source-lang", "source", "--target-lang", "target", "--joined-dictionary",
              "--trainpref", str(pieces / "train"), "--validpref", str(pieces / "valid"),
              "--testpref", str(pieces / "test")],
             args.workers, extra_files=[pieces / SPM_MODEL])
    log_counts(NAME, "article-summary pairs", {split: count_lines(pieces / f"{split}.source") for split in SPLITS})


if __name__ == "__main__":
    run_cli(main)
