"""Debian packages as a source of text: for prepare_debian_de_en.py and prepare_debian_docs.py.

Without --raw the packages are downloaded the way apt does it, without apt
(so any machine with Python gets the same files): the release's InRelease
gives the SHA256 of its package index, the index gives each package's pool
file and SHA256, and every file is verified before it is used. The index is
kept in the work folder, so a rerun resolves the same versions, offline.
With --raw, every .deb in the folder (e.g. from `apt-get download NAME`) is
read instead, and so are loose files of the script's kind (catalogs, HTML
pages): a top-level file is its own group, a subfolder's files one group.

The packages read, with their versions and SHA256, go into the settings the
dest is stamped with, so the data says where it came from.
"""

import io
import lzma
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

from fairseq_feedback_cli.command_line import fail
from fairseq_feedback_cli.data_prep.arguments import log
from fairseq_feedback_cli.data_prep.downloads import Archive, download, file_digest

MIRROR = "https://deb.debian.org/debian"
RELEASE = "bookworm"  # Debian 12: its versions change only with point releases
# An architecture's index lists the "all" packages too, and architecture-specific
# packages carry the same text on every architecture.
INDEX = "main/binary-amd64/Packages.xz"


@dataclass(frozen=True)
class Input:
    """One file the corpus is read from: a .deb, or a loose file of --raw."""

    path: Path
    group: str  # what a split keeps together: the source package, or the --raw subfolder
    name: str  # the binary package, or the path inside --raw
    version: str  # the package's version; empty for a loose file
    sha256: str


def add_arguments(parser, packages: Sequence[str]) -> None:
    parser.add_argument("--packages", nargs="+", default=list(packages), metavar="NAME",
                        help="binary packages to download (default: %(default)s); ignored with --raw")
    parser.add_argument("--mirror", default=MIRROR, help="Debian mirror (default: %(default)s)")
    parser.add_argument("--release", default=RELEASE, help="Debian release (default: %(default)s)")


# ---------------------------------------------------------------- download


def _index_checksum(mirror: str, release: str) -> str:
    url = f"{mirror}/dists/{release}/InRelease"
    log(f"reading {url}")
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (OSError, ValueError) as e:
        fail(f"could not read {url} ({e}); check --mirror and --release, or download the packages "
             f"(apt-get download NAME ...) into a folder and pass --raw FOLDER")
    section = text.split("\nSHA256:\n", 1)[-1]
    for line in section.splitlines():
        if not line.startswith(" "):
            break
        digest, _, path = line.split()
        if path == INDEX:
            return "sha256:" + digest
    fail(f"{url} lists no {INDEX}: is {release} a Debian release on {mirror}?")


def read_index(path: Path) -> Dict[str, Dict[str, str]]:
    """The stanzas of a Packages index, by package name (one-line fields only)."""
    try:
        text = lzma.decompress(path.read_bytes()).decode("utf-8", errors="replace")
    except lzma.LZMAError as e:
        fail(f"cannot read the package index {path} ({e}); delete it and rerun")
    index = {}
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and line[0] != " ")
        if "Package" in fields:
            index[fields["Package"]] = fields
    return index


def download_packages(names: Sequence[str], mirror: str, release: str, folder: Path) -> List[Path]:
    """The packages' .deb files in `folder`, downloaded and verified against the release's index."""
    index_file = folder / f"{release}_{INDEX.replace('/', '_')}"
    if not index_file.exists():
        download(Archive(index_file.name, (f"{mirror}/dists/{release}/{INDEX}",),
                         _index_checksum(mirror, release), ()), folder)
    index = read_index(index_file)
    missing = [n for n in names if n not in index]
    if missing:
        fail(f"{release} has no package {', '.join(missing)}: fix --packages (or delete {index_file} "
             f"if it is from an older run)")
    paths = []
    for name in names:
        entry = index[name]
        paths.append(download(Archive(Path(entry["Filename"]).name, (f"{mirror}/{entry['Filename']}",),
                                      "sha256:" + entry["SHA256"], ()), folder))
    return paths


# -------------------------------------------------------------- .deb files


def _ar_members(path: Path) -> Dict[str, bytes]:
    """The members of an ar archive (a .deb is one), by name."""
    members = {}
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            fail(f"{path} is not a Debian package (no ar header); delete it and rerun")
        while header := f.read(60):
            if len(header) < 60 or header[58:60] != b"`\n":
                fail(f"{path} is a damaged Debian package; delete it and rerun")
            size = int(header[48:58])
            data = f.read(size + size % 2)[:size]
            if len(data) < size:
                fail(f"{path} is cut short; delete it and rerun")
            members[header[:16].decode("ascii", errors="replace").strip().rstrip("/")] = data
    return members


def _tar(path: Path, members: Dict[str, bytes], kind: str) -> tarfile.TarFile:
    name = next((m for m in members if m.startswith(f"{kind}.tar")), None)
    if name is None:
        fail(f"{path} has no {kind}.tar member: is it a Debian package?")
    if name.endswith(".zst"):  # Python reads zstd from 3.14 on
        fail(f"{path} compresses its files with zstd; unpack it with `dpkg-deb -x {path.name} FOLDER` "
             f"and put FOLDER into --raw instead")
    try:
        return tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*")
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        fail(f"cannot read {name} of {path} ({e}); delete it and rerun")


def deb_control(path: Path) -> Dict[str, str]:
    with _tar(path, _ar_members(path), "control") as tf:
        for info in tf:
            if info.name.lstrip("./") == "control":
                text = tf.extractfile(info).read().decode("utf-8", errors="replace")
                return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line and line[0] != " ")
    fail(f"{path} has no control file: is it a Debian package?")


def deb_files(path: Path, wanted: Callable[[str], bool]) -> Iterator[Tuple[str, bytes]]:
    """(path, content) of the package's regular files whose path (without "./") is wanted."""
    try:
        with _tar(path, _ar_members(path), "data") as tf:
            for info in tf:
                name = info.name[2:] if info.name.startswith("./") else info.name
                if info.isfile() and wanted(name):
                    yield name, tf.extractfile(info).read()
    except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
        fail(f"cannot read the files of {path} ({e}); delete it and rerun")


# ------------------------------------------------------------------ inputs


def _deb_input(path: Path) -> Input:
    control = deb_control(path)
    name = control.get("Package") or fail(f"{path} names no package in its control file")
    source = control.get("Source", name).split()[0]  # "glibc (2.36-9)": built from another version
    return Input(path, source, name, control.get("Version", ""), file_digest(path, "sha256"))


def gather(args, loose_suffixes: Sequence[str]) -> List[Input]:
    """The inputs: the downloaded --packages, or everything of use in --raw."""
    if args.raw is None:
        paths = download_packages(args.packages, args.mirror, args.release, args.work / "downloads")
        return [_deb_input(p) for p in paths]
    inputs = []
    for path in sorted(p for p in args.raw.rglob("*") if p.is_file()):
        rel = path.relative_to(args.raw)
        if path.suffix == ".deb":
            inputs.append(_deb_input(path))
        elif path.suffix in loose_suffixes:
            group = rel.parts[0] if len(rel.parts) > 1 else path.stem
            inputs.append(Input(path, group, rel.as_posix(), "", file_digest(path, "sha256")))
    if not inputs:
        fail(f"--raw {args.raw} holds no .deb or {'/'.join(loose_suffixes)} files")
    return inputs


def manifest(inputs: Iterable[Input]) -> Dict[str, dict]:
    """What the data was made from, for the dest's settings."""
    return {i.name: {"source": i.group, "version": i.version, "sha256": i.sha256} for i in inputs}


# ------------------------------------------------------------------ splits

SPLITS = ("test", "valid", "train")


def normalized(text: str) -> str:
    """What counts as the same text across splits: case and spacing aside."""
    return " ".join(text.casefold().split())


def without_repeats(splits: Dict[str, list], key: Callable) -> Tuple[Dict[str, list], Dict[str, int]]:
    """Each split's items with every key once in the whole corpus: a key already
    seen in test (then valid, then earlier in the same split) is dropped.
    Returns the kept items and how many were dropped, by split."""
    seen, kept, dropped = set(), {}, {}
    for split in SPLITS:
        kept[split] = []
        for item in splits[split]:
            k = key(item)
            if k not in seen:
                seen.add(k)
                kept[split].append(item)
        dropped[split] = len(splits[split]) - len(kept[split])
    return kept, dropped


def print_table(rows: List[Sequence], header: Sequence[str]) -> None:
    """A plain text table on stdout: the counts a script produced."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).rjust(w) if isinstance(c, int) else str(c).ljust(w) for c, w in zip(r, widths)))
