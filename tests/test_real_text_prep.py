"""prepare_debian_de_en and prepare_debian_docs on tiny Debian packages,
catalogs and pages in their real formats (tests/data_prep_fixtures.py)."""

import functools
import hashlib
import re
import http.server
import json
import lzma
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fairseq.data import Dictionary, data_utils

import data_prep_fixtures as fx
from helpers import run_script, script_error
from fairseq_feedback_cli.data_prep import prepare_debian_de_en as de_en
from fairseq_feedback_cli.data_prep import prepare_debian_docs as docs
from fairseq_feedback_cli.data_prep.debian import normalized
from fairseq_feedback_cli.data_prep.text import moses

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("preprocess_in_this_process")


def dirs(tmp_path):
    return ["--dest", tmp_path / "data-bin" / "out", "--work", tmp_path / "work", "--workers", 1]


def lines(path: Path) -> list:
    return path.read_text(encoding="utf-8").splitlines()


def sizes(dest: Path, prefix: str, dictionary: str) -> int:
    return len(data_utils.load_indexed_dataset(str(dest / prefix), Dictionary.load(str(dest / dictionary))))


@pytest.fixture(scope="module")
def de_en_raw(tmp_path_factory):
    raw = tmp_path_factory.mktemp("de_en") / "raw"
    return raw, fx.write_debian_de_en(raw)


# ------------------------------------------------------------------ de-en


def test_de_en_pairs_cleaned_deduplicated_and_split_by_source_package(tmp_path, de_en_raw, capsys):
    raw, expected = de_en_raw
    run_script(de_en, "--raw", raw, *dirs(tmp_path), "--bpe-merges", 100)
    out = capsys.readouterr().out
    pairs = expected["pairs"]
    assert f"pairs: test {pairs['test']}, valid {pairs['valid']}, train {pairs['train']}" in out
    assert re.search(r"^gimp +gimp-data +2\.10\.34-1 +train +1 +40 +34$", out, flags=re.M)  # what each gave
    dest, text = tmp_path / "data-bin" / "out", tmp_path / "work" / "text"
    for split, n in pairs.items():
        assert [sizes(dest, f"{split}.de-en.{lang}", f"dict.{lang}.txt") for lang in ("de", "en")] == [n, n]
        assert len(lines(text / f"{split}.raw.en")) == len(lines(text / f"{split}.en")) == n
    assert json.loads((dest / "counts.json").read_text())["dropped"] == expected["dropped"]

    # where it came from: every input with its source package and version
    settings = json.loads((dest / "data_prep.json").read_text())
    assert settings["sources"]["gimp-data"]["source"] == "gimp"
    assert settings["sources"]["inkscape"] == {"source": "inkscape", "version": "1.2.2-2+b1",
                                               "sha256": fx.sha256(next(raw.glob("inkscape_*.deb")))[7:]}
    assert settings["sources"]["gnucash/po/de.po"]["source"] == "gnucash"
    assert settings["test"] == ["coreutils", "gnucash"]

    train_en, train_de = lines(text / "train.raw.en"), lines(text / "train.raw.de")
    for en, de in (("Save the document now", "Das Dokument jetzt speichern"),  # accelerators
                   ("Bold text is shown here", "Fetter Text wird hier angezeigt"),  # markup
                   ("Close the current window", "Das aktuelle Fenster schließen"),  # context
                   ("Copy & paste the selected text", "Ausgewählten Text kopieren & einfügen"),  # entities
                   ("Insert a new table", "Neue Tabelle einfügen")):  # a catalog outside /usr/share/locale
        assert train_de[train_en.index(en)] == de
    assert not any("Bonjour" in s or "Österreich" in s for s in train_en + train_de)  # fr and de_AT: not read
    assert lines(text / "valid.raw.en").count("Print the current page") == 1
    test_en = lines(text / "test.raw.en")
    assert {"Show the hidden files", "Copy the selected text to the clipboard",
            'Line one and line two are "here"'} <= set(test_en)
    assert lines(dest / "test.raw.en") == test_en  # the references, beside the data
    seen = [normalized(s) for split in ("test", "valid", "train") for s in lines(text / f"{split}.raw.en")]
    assert len(seen) == len(set(seen))  # no English sentence twice, across splits or within one

    run_script(de_en, "--raw", raw, *dirs(tmp_path), "--bpe-merges", 100)  # a rerun has nothing to do
    assert "complete already" in capsys.readouterr().err


def broken_copy(raw: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    copy = tmp_path / "raw"
    shutil.copytree(raw, copy)
    (copy / name).parent.mkdir(parents=True, exist_ok=True)
    (copy / name).write_bytes(content)
    return copy


def test_de_en_bad_inputs_are_one_line_errors(tmp_path, de_en_raw):
    raw, _ = de_en_raw
    gimp = next(raw.glob("gimp-data_*.deb")).name
    cases = [
        (gimp, next(raw.glob("gimp-data_*.deb")).read_bytes()[:1500], f"{gimp} is cut short"),
        ("broken_1.0_all.deb", b"<html>not found</html>", "broken_1.0_all.deb is not a Debian package"),
        ("tar.mo", b"\x00" * 40, "tar.mo is not a gettext .mo catalog"),
        ("tar.mo", (raw / "tar.mo").read_bytes()[:200], "tar.mo is a damaged .mo catalog"),
        ("gnucash/po/de.po", b'msgid "a"\nmsgstr "b"\nnonsense\n', "de.po line 3 is not gettext .po syntax"),
        ("gnucash/po/de.po", b'msgid ""\nmsgstr "Language: fr\\n"\n', "is a catalog for fr, not German"),
    ]
    for i, (name, content, message) in enumerate(cases):
        case = tmp_path / str(i)
        assert message in script_error(de_en, "--raw", broken_copy(raw, case, name, content), *dirs(case))
        assert not (case / "data-bin").exists()
    assert "not a folder" in script_error(de_en, "--raw", tmp_path / "missing", *dirs(tmp_path))
    (tmp_path / "empty").mkdir()
    assert "holds no .deb or .mo/.po files" in script_error(de_en, "--raw", tmp_path / "empty", *dirs(tmp_path))
    assert "--test nosuch: no input comes from it; the inputs' source packages are coreutils gimp gnucash" in \
        script_error(de_en, "--raw", raw, *dirs(tmp_path), "--test", "nosuch")


@pytest.mark.slow
def test_de_en_command_line_error_is_one_line_without_traceback(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "fairseq_feedback_cli.data_prep.prepare_debian_de_en",
                           "--raw", str(tmp_path / "empty"), "--dest", str(tmp_path / "d")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: ")


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def mirror(tmp_path, de_en_raw, monkeypatch):
    """A Debian mirror on localhost serving the fixture's packages: InRelease, the index, the pool."""
    raw, _ = de_en_raw
    root = tmp_path / "mirror"
    stanzas = []
    for deb in sorted(raw.glob("*.deb")):
        package = deb.name.split("_")[0]
        pool = root / "pool" / "main" / package[0] / package / deb.name
        pool.parent.mkdir(parents=True)
        shutil.copy(deb, pool)
        stanzas.append(f"Package: {package}\nVersion: {deb.name.split('_')[1]}\nDescription: a test\n continued\n"
                       f"Filename: {pool.relative_to(root)}\nSize: {deb.stat().st_size}\n"
                       f"SHA256: {fx.sha256(deb)[7:]}\n")
    index = root / "dists" / "testing" / "main" / "binary-amd64" / "Packages.xz"
    index.parent.mkdir(parents=True)

    def publish(stanzas):
        index.write_bytes(lzma.compress("\n".join(stanzas).encode()))
        (root / "dists" / "testing" / "InRelease").write_text(
            "Origin: Debian\nSuite: testing\nSHA256:\n"
            f" {hashlib.sha256(b'x').hexdigest()} 1 main/binary-amd64/Packages\n"
            f" {fx.sha256(index)[7:]} {index.stat().st_size} main/binary-amd64/Packages.xz\n"
            "-----BEGIN PGP SIGNATURE-----\n")

    publish(stanzas)
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", stanzas, publish
    httpd.shutdown()
    httpd.server_close()


def test_de_en_downloads_verified_packages_from_the_release_index(tmp_path, mirror):
    url, stanzas, publish = mirror
    download = ["--mirror", url, "--release", "testing", "--test", "coreutils", "--valid", "gnumeric"]
    assert "testing has no package nosuch" in script_error(
        de_en, *download, "--packages", "gimp-data", "nosuch", *dirs(tmp_path))

    publish([s.replace("SHA256: ", "SHA256: 0") if s.startswith("Package: inkscape") else s for s in stanzas])
    fresh = tmp_path / "corrupt"
    assert "downloaded inkscape_1.2.2-2+b1_amd64.deb is corrupt" in script_error(
        de_en, *download, "--packages", "gimp-data", "inkscape", "coreutils", "gnumeric-common", *dirs(fresh))
    assert not (fresh / "data-bin").exists()

    publish(stanzas)
    run_script(de_en, *download, "--packages", "gimp-data", "inkscape", "coreutils", "gnumeric-common", *dirs(tmp_path),
        "--bpe-merges", 50)
    downloads = tmp_path / "work" / "downloads"
    assert sorted(p.name.split("_")[0] for p in downloads.glob("*.deb")) == \
        ["coreutils", "gimp-data", "gnumeric-common", "inkscape"]
    assert (downloads / "testing_main_binary-amd64_Packages.xz").exists()  # kept: a rerun resolves offline
    sources = json.loads((tmp_path / "data-bin" / "out" / "data_prep.json").read_text())["sources"]
    assert sorted(sources) == ["coreutils", "gimp-data", "gnumeric-common", "inkscape"]
    assert sources["gnumeric-common"]["version"] == "1.12.55-1"


# ------------------------------------------------------------------- docs


def test_docs_prose_paragraphs_split_by_page(tmp_path, capsys):
    expected = fx.write_debian_docs(tmp_path / "raw")
    run_script(docs, "--raw", tmp_path / "raw", *dirs(tmp_path), "--bpe-merges", 100)
    out = capsys.readouterr().out
    counts = {s: len(p) for s, p in expected.items()}
    assert "paragraphs: " + ", ".join(f"{s} {n}" for s, n in counts.items()) in out
    dest, text = tmp_path / "data-bin" / "out", tmp_path / "work" / "text"
    for split, paragraphs in expected.items():
        # in page order, code and markup left out, every paragraph once, each page's in one split
        assert lines(text / f"{split}.txt") == [moses(p, "en") for p in paragraphs]
        assert sizes(dest, split, "dict.txt") == len(paragraphs)
    assert "PREFORMATTED" not in "".join(p for ps in expected.values() for p in ps)
    # a "See also" and a German paragraph on each of 10 pages; the boilerplate of all but one
    dropped = json.loads((dest / "counts.json").read_text())["dropped"]
    repeated = sum(n for k, n in dropped.items() if "repeated" in k)
    assert (dropped["short"], dropped["not prose"], repeated) == (10, 10, 9)
    sources = json.loads((dest / "data_prep.json").read_text())["sources"]
    assert sources["python3.11-doc"]["version"] == "3.11.2-6+deb12u8" and "notes/index.html" in sources


def test_docs_bad_inputs_are_one_line_errors(tmp_path):
    fx.deb(tmp_path / "zst", "linux-doc-6.1", "6.1-1", {})
    zst = next((tmp_path / "zst").glob("*.deb"))
    zst.write_bytes(zst.read_bytes().replace(b"data.tar.xz ", b"data.tar.zst"))
    assert "compresses its files with zstd; unpack it with `dpkg-deb -x" in script_error(
        docs, "--raw", tmp_path / "zst", *dirs(tmp_path))
    fx.write(tmp_path / "text" / "notes.txt", ["no pages here"])
    assert "holds no .deb or .html/.htm files" in script_error(docs, "--raw", tmp_path / "text", *dirs(tmp_path))
    fx.write(tmp_path / "few" / "page.html", ["<p>One paragraph of prose is not enough for the three splits.</p>"])
    assert "a split has no text" in script_error(docs, "--raw", tmp_path / "few", *dirs(tmp_path))
    assert not (tmp_path / "data-bin").exists()


# --------------------------------------------------------------- fixtures


def test_the_fixtures_are_what_debian_and_gettext_tools_read(tmp_path, de_en_raw):
    """The .deb, .mo and .po files above are real: dpkg-deb, gettext and msgfmt read them."""
    import gettext
    import io

    raw, _ = de_en_raw
    catalog = gettext.GNUTranslations(io.BytesIO((raw / "tar.mo").read_bytes()))
    assert catalog.info()["language"] == "de" and len(catalog._catalog) == 4  # the header and 3 pairs
    deb = next(raw.glob("inkscape_*.deb"))
    if shutil.which("dpkg-deb"):
        listing = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True)
        assert "./usr/share/locale/de/LC_MESSAGES/inkscape.mo" in listing.stdout
        field = subprocess.run(["dpkg-deb", "--field", str(deb), "Version"], capture_output=True, text=True)
        assert field.stdout.strip() == "1.2.2-2+b1"
    if shutil.which("msgfmt"):
        subprocess.run(["msgfmt", "--check", "-o", str(tmp_path / "de.mo"), str(raw / "gnucash" / "po" / "de.po")],
                       check=True, capture_output=True)
        compiled = gettext.GNUTranslations(io.BytesIO((tmp_path / "de.mo").read_bytes()))._catalog
        assert compiled["Show the hidden files"] == "Die versteckten Dateien anzeigen"
        assert "Delete all the old backups" not in compiled  # fuzzy: msgfmt leaves it out, as the script does
