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

import hashlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the data_prep package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep.arguments import log, make_parser, resolve_dirs, run_cli
from fairseq_feedback_cli.data_prep.downloads import Archive, describe_sources, gather_inputs
from fairseq_feedback_cli.data_prep.steps import identity
from fairseq_feedback_cli.data_prep.text import pmap, read_lines, read_pairs
from fairseq_feedback_cli.data_prep.translation import Corpus, SentencePiece, prepare_translation

NAME = "cnn_dm"
SPLITS = {"train": "train", "valid": "val", "test": "test"}  # ours -> the url lists' / line files' names
SIDES = ("source", "target")
ARTICLE_WORDS = 400
SPM_MODEL = SentencePiece.model  # beside the binarized data
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


def text_from_stories(out: Path, inputs: dict, workers: int) -> None:
    story_dirs = [inputs["cnn/stories/"], inputs["dailymail/stories/"]]
    for split, theirs in SPLITS.items():
        urls = [u.strip() for u in read_lines(inputs[f"url_lists/all_{theirs}.txt"]) if u.strip()]
        paths = [_story_path(u, story_dirs) for u in urls]
        pairs = pmap(read_story, paths, workers, f"read {split} stories", total=len(paths))
        write_pairs(out, split, pairs)


def text_from_lines(out: Path, inputs: Path, workers: int) -> None:
    """`inputs`: the --raw folder of line files."""
    for split, theirs in SPLITS.items():
        write_pairs(out, split, read_pairs(inputs / f"{theirs}.source", inputs / f"{theirs}.target"))


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


def main(argv=None) -> None:
    parser = make_parser(NAME, __doc__)
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="sentencepiece BPE vocabulary size (default: %(default)s)")
    args = parser.parse_args(argv)
    resolve_dirs(args)
    line_files = [f"{theirs}.{side}" for theirs in SPLITS.values() for side in SIDES]
    from_lines = args.raw is not None and any((args.raw / f).exists() for f in line_files)
    archives = list(ARCHIVES.values())
    if from_lines:
        missing = [f for f in line_files if not (args.raw / f).is_file()]
        if missing:
            fail(f"{args.raw} has some line files but not {missing[0]}")
        sources = {f: identity(args.raw / f) for f in line_files}
    else:
        sources = describe_sources(archives, args.raw)
    prepare_translation(args, Corpus(
        NAME, SIDES, {"dataset": NAME, "input": "line files" if from_lines else "stories", "sources": sources},
        inputs=(lambda: args.raw) if from_lines else (lambda: gather_inputs(archives, args.raw, args.work)),
        make_text=text_from_lines if from_lines else text_from_stories,
        subwords=SentencePiece(args.vocab_size),
        after_text=lambda text: log(f"detokenized test summaries (ROUGE references): {text / 'test.target'}"),
        what="article-summary pairs"))


if __name__ == "__main__":
    run_cli(main)
