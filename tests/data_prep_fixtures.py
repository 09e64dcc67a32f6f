"""Tiny raw datasets in the real formats of the official archives, for tests/test_data_prep.py.

Each writer returns what the test needs to know to check the output (how
many pairs survive cleaning, and so on).
"""

import hashlib
import random
import tarfile
import zipfile
from pathlib import Path

EN = ("the house is small and the garden is green but the street is loud at night "
      "we have seen many people walking to the old market near the river every morning "
      "she reads a famous book about history while he writes letters to his friends").split()
DE = ("das haus ist klein und der garten ist grün aber die straße ist laut in der nacht "
      "wir haben viele leute gesehen die zum alten markt am fluss gehen jeden morgen "
      "sie liest ein bekanntes buch über geschichte während er briefe an seine freunde schreibt").split()


def sentence(rng: random.Random, words, n: int) -> str:
    s = " ".join(rng.choice(words) for _ in range(n))
    return s[0].upper() + s[1:] + "."


def parallel(rng: random.Random, n_pairs: int):
    """Pairs of equal word count, so BPE keeps their length ratio near 1."""
    for _ in range(n_pairs):
        n = rng.randint(6, 12)
        yield sentence(rng, DE, n), sentence(rng, EN, n)


def write(path: Path, lines) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def tgz(archive: Path, root: Path, top: str) -> Path:
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(root / top, arcname=top)
    return archive


# ------------------------------------------------------------------ IWSLT14

IWSLT_TEST_SETS = ("IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
                   "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012")


def _talk_header(talk: int, lang: str):
    return [
        f"<url>http://www.ted.com/talks/talk_{talk}.html</url>",
        f"<keywords>talks, science, {lang}</keywords>",
        f"<speaker>Person {talk}</speaker>",
        f"<talkid>{100 + talk}</talkid>",
        f"<title>Person {talk}: a talk in {lang}</title>",
        f"<description>TED Talk Subtitles and Transcript: talk {talk} ({lang})</description>",
        '<reviewer href="http://www.ted.com/profiles/1">Some Reviewer</reviewer>',
        '<translator href="http://www.ted.com/profiles/2">Some Translator</translator>',
    ]


def write_iwslt(root: Path) -> dict:
    """root/de-en/ as in de-en.tgz: tagged train files and the five .xml dev/test sets."""
    rng = random.Random(14)
    pairs = list(parallel(rng, 60))
    # three pairs that clean-corpus-n drops: too unequal (twice) and too long
    pairs[5] = ("Ja.", pairs[5][1])
    pairs[17] = (pairs[17][0], "Yes.")
    pairs[40] = (" ".join([pairs[40][0]] * 30), " ".join([pairs[40][1]] * 30))
    pairs[10] = (pairs[10][0], "<3 " + pairs[10][1])  # a sentence, not a tag: kept
    de, en = [], []
    for talk in range(3):
        de += _talk_header(talk, "de")
        en += _talk_header(talk, "en")
        for d, e in pairs[talk * 20:(talk + 1) * 20]:
            de.append(d)
            en.append(e)
    write(root / "de-en" / "train.tags.de-en.de", de)
    write(root / "de-en" / "train.tags.de-en.en", en)
    n_test = 0
    for i, name in enumerate(IWSLT_TEST_SETS):
        segs = list(parallel(rng, 3 + i))
        segs[0] = (segs[0][0], "It’s " + segs[0][1])  # the recipe straightens ’
        n_test += len(segs)
        for lang, side in (("de", 0), ("en", 1)):
            write(root / "de-en" / f"{name}.de-en.{lang}.xml", [
                '<?xml version="1.0" encoding="UTF-8"?>',
                "<mteval>",
                f'<srcset setid="iwslt2014-{name}" srclang="{lang}">',
                f'<doc docid="{500 + i}" genre="lectures">',
                f"<url>http://www.ted.com/talks/test_{i}.html</url>",
                "<keywords>talks</keywords>",
                f"<talkid>{500 + i}</talkid>",
                f"<title>Test talk {i}</title>",
                *[f'<seg id="{j + 1}"> {seg[side]} </seg>' for j, seg in enumerate(segs)],
                "</doc>",
                "</srcset>",
                "</mteval>",
            ])
    write(root / "de-en" / "README", ["IWSLT 2014 de-en"])
    kept = 60 - 3 + 3 * 2  # and the text of each talk's <title> and <description>
    return {"train": kept - kept // 23, "valid": kept // 23, "test": n_test}


def iwslt_archive(tmp: Path) -> Path:
    """de-en.tgz with the real archive's layout, alone in a fresh folder."""
    write_iwslt(tmp / "src")
    (tmp / "raw").mkdir()
    return tgz(tmp / "raw" / "de-en.tgz", tmp / "src", "de-en")


# ------------------------------------------------------------------- WMT14

def _sgm(setid: str, lang: str, sysid: str, segs) -> list:
    return ([f'<{"srcset" if sysid == "src" else "refset"} setid="{setid}" srclang="any" trglang="{lang}">',
             f'<doc sysid="{sysid}" docid="1012-bbc" genre="news" origlang="en">', "<p>"]
            + [f'<seg id="{i + 1}">{s}</seg>' for i, s in enumerate(segs)]
            + ["</p>", "</doc>", "</srcset>" if sysid == "src" else "</refset>"])


def write_wmt(root: Path, news_commentary: str = "v9") -> dict:
    """root/ as the five statmt.org archives extracted side by side."""
    rng = random.Random(2014)
    n_train = dropped = 0
    for prefix, n in (("training/europarl-v7.de-en", 25), ("commoncrawl.de-en", 15),
                      (f"training/news-commentary-{news_commentary}.de-en", 10)):
        pairs = list(parallel(rng, n))
        if prefix == "commoncrawl.de-en":
            pairs[3] = ("Ja.", pairs[3][1])  # ratio: dropped
            pairs[7] = (" ".join([pairs[7][0]] * 40), " ".join([pairs[7][1]] * 40))  # > 250: dropped
            dropped += 2
        # for the normalization and the aggressive hyphen splitting
        pairs[1] = (pairs[1][0] + " Ein gut–bekanntes Buch.", pairs[1][1] + " A “well-known” book.")
        write(root / f"{prefix}.de", [p[0] for p in pairs])
        write(root / f"{prefix}.en", [p[1] for p in pairs])
        n_train += n
    valid = list(parallel(rng, 8))
    write(root / "dev" / "newstest2013.de", [p[0] for p in valid])
    write(root / "dev" / "newstest2013.en", [p[1] for p in valid])
    test = list(parallel(rng, 6))
    test[0] = (test[0][0], "It’s " + test[0][1])
    write(root / "test-full" / "newstest2014-deen-src.en.sgm", _sgm("newstest2014", "en", "src", [p[1] for p in test]))
    write(root / "test-full" / "newstest2014-deen-ref.de.sgm", _sgm("newstest2014", "de", "ref", [p[0] for p in test]))
    return {"train": n_train - dropped, "valid": len(valid), "test": len(test)}


# ----------------------------------------------------------- CNN-DailyMail

def _story(rng: random.Random, n_lines: int, n_highlights: int, long: bool = False) -> str:
    body = [sentence(rng, EN, rng.randint(8, 20)) for _ in range(n_lines)]
    body[0] = "(CNN) -- " + body[0]
    body.append("Photo: a caption without a period")
    if long:
        body += [sentence(rng, EN, 50) for _ in range(10)]
    out = []
    for line in body:
        out += [line, ""]
    for _ in range(n_highlights):
        out += ["@highlight", "", sentence(rng, EN, 8)[:-1], ""]  # highlights come without periods
    return "\n".join(out)


def write_cnn_dm(root: Path) -> dict:
    """root/cnn/stories, root/dailymail/stories and root/url_lists/all_*.txt."""
    rng = random.Random(400)
    counts = {}
    for split, n in (("train", 12), ("val", 4), ("test", 4)):
        urls = []
        for i in range(n):
            site = "cnn" if i % 2 else "dailymail"
            url = (f"http://web.archive.org/web/2015/http://www.cnn.com/2015/{split}/{i}/story.html" if site == "cnn"
                   else f"http://www.dailymail.co.uk/news/article-{split}{i}/Story.html")
            urls.append(url)
            text = _story(rng, rng.randint(3, 8), rng.randint(2, 4), long=(split == "train" and i == 0))
            if split == "train" and i == 1:  # article text missing, as a hundred or so real ones
                text = text[text.index("@highlight"):]
            name = hashlib.sha1(url.encode()).hexdigest() + ".story"
            write(root / site / "stories" / name, [text])
        write(root / "url_lists" / f"all_{split}.txt", urls)
        counts[split] = n
    return {"train": counts["train"] - 1, "valid": counts["val"], "test": counts["test"]}


def write_cnn_dm_lines(root: Path) -> dict:
    """{train,val,test}.{source,target}: one article / summary per line."""
    rng = random.Random(401)
    counts = {}
    for split, n in (("train", 10), ("val", 3), ("test", 3)):
        write(root / f"{split}.source", [" ".join(sentence(rng, EN, 30) for _ in range(20)) for _ in range(n)])
        write(root / f"{split}.target", [sentence(rng, EN, 12) for _ in range(n)])
        counts["valid" if split == "val" else split] = n
    return counts


# ---------------------------------------------------------------- WikiText

def write_wikitext(root: Path) -> dict:
    """root/wikitext-103/wiki.{train,valid,test}.tokens: articles of ` = Title = ` and token lines."""
    rng = random.Random(103)
    counts = {}
    for split, n_articles in (("train", 4), ("valid", 1), ("test", 1)):
        lines = []
        for a in range(n_articles):
            lines += [" ", f" = Article {split} {a} = ", " "]
            for section in range(2):
                lines += [f" = = Section {section} = = ", " "]
                for _ in range(3):
                    words = [w if rng.random() > 0.05 else "<unk>" for w in sentence(rng, EN, 15).split()]
                    lines += [" " + " ".join(words) + " , a well @-@ known one . ", " "]
        write(root / "wikitext-103" / f"wiki.{split}.tokens", lines)
        counts[split] = len(lines)
    return counts


def wikitext_archive(tmp: Path) -> Path:
    write_wikitext(tmp / "src")
    (tmp / "raw").mkdir()
    archive = tmp / "raw" / "wikitext-103-v1.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in sorted((tmp / "src").rglob("*")):
            zf.write(f, f.relative_to(tmp / "src").as_posix())
    return archive
