"""Tiny raw datasets in the real formats of the official archives, for tests/test_data_prep.py.

Each writer returns what the test needs to know to check the output (how
many pairs survive cleaning, and so on).
"""

import hashlib
import io
import random
import struct
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


# ------------------------------------------------------------------ Debian


def mo_catalog(messages: dict) -> bytes:
    """A GNU .mo catalog as msgfmt writes it: little-endian, originals sorted, no hash table."""
    keys = sorted(messages)
    strings = [k.encode() for k in keys] + [messages[k].encode() for k in keys]
    n, start = len(keys), 28 + 16 * len(keys)
    table, data = b"", b""
    for s in strings:
        table += struct.pack("<2I", len(s), start + len(data))
        data += s + b"\0"
    return struct.pack("<7I", 0x950412DE, 0, n, 28, 28 + 8 * n, 0, 0) + table + data


def _tar_xz(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size, info.mode = len(data), 0o644
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def deb(folder: Path, package: str, version: str, files: dict, source: str = None, arch: str = "all") -> Path:
    """A binary package as dpkg-deb --build writes it: an ar archive of
    debian-binary, control.tar.xz and data.tar.xz."""
    control = f"Package: {package}\n" + (f"Source: {source}\n" if source else "") + \
        f"Version: {version}\nArchitecture: {arch}\nMaintainer: A Tester <tester@example.org>\n" \
        f"Description: {package} for the tests\n a test package\n"
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", _tar_xz({"control": control.encode()})),
               ("data.tar.xz", _tar_xz(files))]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{package}_{version.split(':')[-1]}_{arch}.deb"
    path.write_bytes(out)
    return path


GETTEXT_HEADER = ("Project-Id-Version: {name} 1.0\nLanguage: {lang}\nMIME-Version: 1.0\n"
                  "Content-Type: text/plain; charset=UTF-8\nContent-Transfer-Encoding: 8bit\n"
                  "Plural-Forms: nplurals=2; plural=(n != 1);\n")


def _catalog(name: str, pairs, lang="de", **special) -> bytes:
    return mo_catalog({"": GETTEXT_HEADER.format(name=name, lang=lang), **{en: de for de, en in pairs}, **special})


GNUCASH_PO = r'''# German translation of the test package.
msgid ""
msgstr ""
"Project-Id-Version: gnucash 4.13\n"
"Language: de\n"
"Content-Type: text/plain; charset=UTF-8\n"
"Plural-Forms: nplurals=2; plural=(n != 1);\n"

#: gnucash/gnome/dialog.c:10
msgid "Show the hidden files"
msgstr "Die versteckten Dateien anzeigen"

#: gnucash/gnome/dialog.c:20
#, fuzzy, c-format
msgid "Delete all the old backups"
msgstr "Alle alten Sicherungen löschen"

msgctxt "Action"
msgid ""
"Copy the &selected text "
"to the clipboard"
msgstr ""
"Den &ausgewählten Text in die "
"Zwischenablage kopieren"

msgid "Line one\n"
"and line two are \"here\""
msgstr "Zeile eins\nund Zeile zwei sind \"hier\""

msgid "One account was closed"
msgid_plural "%d accounts were closed"
msgstr[0] "Ein Konto wurde geschlossen"
msgstr[1] "%d Konten wurden geschlossen"

#~ msgid "An obsolete message of the file"
#~ msgstr "Eine veraltete Meldung der Datei"
'''


def write_debian_de_en(root: Path) -> dict:
    """What prepare_debian_de_en reads from --raw, named as its default splits
    expect: .deb packages holding German (and other) catalogs, the test source
    gnucash as a loose .po (gnucash/po/de.po), the valid source tar as a loose
    .mo (tar.mo). Returns the pairs each split keeps and the entries each
    reason drops."""
    rng = random.Random(12)
    bulk = {name: list(parallel(rng, n)) for name, n in
            (("gimp", 30), ("inkscape", 12), ("gnumeric", 4), ("tar", 3), ("coreutils", 4), ("gnucash", 3))}
    gimp = _catalog("gimp", bulk["gimp"], **{
        "_Save the document now": "Das Dokument jetzt _speichern",
        "<b>Bold</b> text is shown here": "<b>Fetter</b> Text wird hier angezeigt",
        "menu\x04Close the current window": "Das aktuelle Fenster schließen",
        "Copy &amp; paste the selected text": "Ausgewählten Text kopieren &amp; einfügen",
        "%s: %d%%": "%s: %d %%",  # placeholders only
        "One file was deleted\x00%d files were deleted": "Eine Datei wurde gelöscht\x00%d Dateien wurden gelöscht",
        "Quit the program now": "Quit the program now",  # untranslated
        "Open": "Öffnen",  # too short
        "Stop the process": "Den laufenden Prozess sofort und endgültig anhalten ohne zu fragen",  # ratio
        "Show the Hidden  Files": "Versteckte Dateien anzeigen",  # also in the test set
    })
    deb(root, "gimp-data", "2.10.34-1", {
        "usr/share/locale/de/LC_MESSAGES/gimp20.mo": gimp,
        "usr/share/locale/fr/LC_MESSAGES/gimp20.mo": _catalog("gimp", [("Bonjour le monde entier", "x y z")],
                                                              lang="fr"),
        "usr/share/doc/gimp-data/copyright": b"not a catalog\n"}, source="gimp")
    deb(root, "inkscape", "1.2.2-2+b1", {
        "usr/share/locale/de/LC_MESSAGES/inkscape.mo": _catalog("inkscape", bulk["inkscape"], **{
            "Print the current page": "Die aktuelle Seite drucken"}),  # also in the valid set
        "usr/lib/inkscape/resource/de/LC_MESSAGES/extra.mo": _catalog("extra", [], **{
            "~Insert a new table": "Neue Tabelle ~einfügen"}),
        "usr/share/locale/de_AT/LC_MESSAGES/inkscape.mo": _catalog("inkscape", [("Ein Satz in Österreich", "x")])},
        arch="amd64")
    deb(root, "gnumeric-common", "1.12.55-1", {"usr/share/locale/de/LC_MESSAGES/gnumeric-1.12.mo": _catalog(
        "gnumeric", bulk["gnumeric"], **{"Print the current page": "Die aktuelle Seite drucken"})}, source="gnumeric")
    deb(root, "coreutils", "9.1-1", {"usr/share/locale/de/LC_MESSAGES/coreutils.mo":
                                     _catalog("coreutils", bulk["coreutils"])}, arch="amd64")
    (root / "tar.mo").write_bytes(_catalog("tar", bulk["tar"]))
    po = GNUCASH_PO + "".join(f'\nmsgid "{en}"\nmsgstr "{de}"\n' for de, en in bulk["gnucash"])
    write(root / "gnucash" / "po" / "de.po", [po])
    return {"pairs": {"test": 3 + 4 + 3, "valid": 1 + 4 + 3, "train": 4 + 30 + 1 + 12},
            "dropped": {"placeholders only": 1, "plural": 2, "untranslated": 1, "length": 2, "fuzzy": 1,
                        "repeated (test)": 0, "repeated (valid)": 0, "repeated (train)": 2}}


def _page(rng: random.Random, title: str, n: int) -> tuple:
    """An HTML page of a manual as Sphinx writes it, and its n paragraphs of prose."""
    prose = [f"The {rng.choice(EN)} of the {rng.choice(EN)} is described on the page {title}, and it shows how "
             f"the {rng.choice(EN)} can be used with <code>{rng.choice(EN)}()</code> in a program ({i})."
             for i in range(n)]
    body = "\n".join(f"<p>{p}</p>" for p in prose)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><title>{title}</title><style>p {{ margin: 0 }}</style></head>
<body><div class="body"><h1>{title}</h1>
{body}
<div class="highlight"><pre>for the line in the file: print the PREFORMATTED line and go to the next one</pre></div>
<p>See also <a href="index.html">the index</a>.</p>
<p>Diese Seite beschreibt, wie die Module des Handbuchs verwendet werden und was sie tun können.</p>
<p>This page is part of the test manual &amp; it is licensed under the same terms as the rest of it.</p>
</div></body></html>
"""
    return page.encode(), [p.replace("<code>", "").replace("</code>", "") for p in prose]


def docs_split(page: str) -> str:
    """prepare_debian_docs' rule: a hash of the page's name, 2.5% test, 2.5% valid."""
    bucket = int(hashlib.sha256(page.encode()).hexdigest()[:8], 16) % 1000
    return "test" if bucket < 25 else "valid" if bucket < 50 else "train"


def write_debian_docs(root: Path) -> dict:
    """What prepare_debian_docs reads from --raw: a documentation package of
    HTML pages (with code, a short, a German and a repeated paragraph on each)
    and a loose page. Returns each split's prose paragraphs, in order."""
    rng = random.Random(3)
    wanted = {"test": 2, "valid": 2, "train": 5}
    names = []
    for i in range(100000):
        name = f"usr/share/doc/python3.11/html/library/module{i}.html"
        split = docs_split(f"python3.11-doc/{name}")
        if wanted[split]:
            wanted[split] -= 1
            names.append((name, split))
        if not any(wanted.values()):
            break
    boilerplate = "This page is part of the test manual & it is licensed under the same terms as the rest of it."
    paragraphs = {s: [] for s in ("test", "valid", "train")}

    def read(split, prose):  # as the script does: kept once, by the first test page
        paragraphs[split] += prose
        if split == "test" and boilerplate not in paragraphs["test"]:
            paragraphs["test"].append(boilerplate)

    loose, prose = _page(rng, "notes", 2)
    write(root / "notes" / "index.html", [loose.decode()])
    read(docs_split("notes/index.html"), prose)  # notes/ sorts before the .deb
    files = {"usr/share/doc/python3.11/html/_static/basic.css": b"p { margin: 0 }\n"}
    for name, split in sorted(names):
        files[name], prose = _page(rng, name.split("/")[-1], 3)
        read(split, prose)
    deb(root, "python3.11-doc", "3.11.2-6+deb12u8", files, source="python3.11")
    return paragraphs


# ------------------------------------------------------------ character level


def enwik8_bytes() -> bytes:
    """Wikipedia XML as the dump holds it, a few kilobytes, its last byte no
    newline; a byte (of "é") only in the last 400 bytes, test."""
    rng = random.Random(8)
    pages = []
    for i in range(12):
        text = " ".join(sentence(rng, EN, rng.randint(5, 12)) for _ in range(3))
        pages.append(f"  <page>\n    <title>Page {i}</title>\n    <text xml:space=\"preserve\">'''{text}'''\n"
                     f"[[Link {i}|a link]] &amp; {{{{cite}}}}\n\n</text>\n  </page>\n")
    data = "".join(pages).encode() + "Caf\u00e9 <page>".encode()
    assert b"\xa9" not in data[:-400]
    return data


def write_enwik8(root: Path) -> dict:
    """root/enwik8, as enwik8.zip holds it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "enwik8").write_bytes(enwik8_bytes())
    return {}


def enwik8_archive(tmp: Path) -> Path:
    write_enwik8(tmp / "src")
    (tmp / "raw").mkdir()
    with zipfile.ZipFile(tmp / "raw" / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(tmp / "src" / "enwik8", "enwik8")
    return tmp / "raw" / "enwik8.zip"


PTB_WORDS = EN + ["mr.", "u.s.", "n't", "'s", "&", "#", "$", "1\\/2", "a-b", "co.", "inc.", "quiz", "jazz", "oxen"]


def char_ptb_lines() -> dict:
    """Each split's lines of simple-examples/data/ptb.char.*.txt: the word-level
    sentences one character per token, `_` between words, with a leading space
    (as Mikolov's files), `<unk>` and `N` as the word-level text has them, a `%`
    only in test."""
    rng = random.Random(50)
    splits = {}
    for split, n in (("train", 40), ("valid", 6), ("test", 7)):
        lines = []
        for i in range(n):
            words = [rng.choice(PTB_WORDS) for _ in range(rng.randint(4, 9))]
            words += ["<unk>", "N"] if i % 3 == 0 else ["%", "N"] if split == "test" and i == 1 else []
            lines.append(" " + " ".join("_".join(words)))
        splits[split] = lines
    return splits


def write_char_ptb(root: Path) -> dict:
    splits = char_ptb_lines()
    for split, lines in splits.items():
        write(root / "simple-examples" / "data" / f"ptb.char.{split}.txt", lines)
    return splits


def char_ptb_archive(tmp: Path) -> Path:
    write_char_ptb(tmp / "src")
    (tmp / "raw").mkdir()
    return tgz(tmp / "raw" / "simple-examples.tgz", tmp / "src", "simple-examples")
