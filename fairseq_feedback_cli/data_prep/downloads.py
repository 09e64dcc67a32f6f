"""The official archives: downloaded resumably and verified by checksum, or found in --raw (as
archives, or as the files extracted from them), and the files a script reads extracted once."""

import gzip
import hashlib
import http.client
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence

from tqdm import tqdm

from fairseq_feedback_cli.command_line import fail

from .arguments import log
from .steps import identity, step


@dataclass(frozen=True)
class Archive:
    filename: str  # the name on disk
    urls: Sequence[str]  # tried in order
    checksum: str  # "sha256:<hex>" or "md5:<hex>"
    # Paths inside the archive the script reads; a trailing "/" takes a whole folder.
    members: Sequence[str]
    # Not an archive but the input itself; its one member then says where it
    # sits in its repository, e.g. "url_lists/all_train.txt".
    plain: bool = False


def file_digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksum_matches(path: Path, archive: Archive) -> Optional[str]:
    """None when `path` has the archive's checksum, else a description of the mismatch."""
    algo, expected = archive.checksum.split(":", 1)
    log(f"checking the {algo} of {path.name} ...")
    actual = file_digest(path, algo)
    return None if actual == expected else f"{algo} is {actual}, expected {expected}"


def _fetch(url: str, part: Path) -> None:
    """Download url into `part`, resuming from what `part` already holds."""
    have = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": "fairseq-feedback-data-prep"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing past what we have: the part is whole
            return
        raise
    with resp:
        if have and resp.status != 206:  # the server ignored the Range: start over
            have = 0
        if "text/html" in resp.headers.get("Content-Type", ""):
            # e.g. Google Drive's quota or virus-scan page instead of the file
            raise OSError("the server sent a web page, not the file")
        total = None if resp.length is None else have + resp.length
        with open(part, "ab" if have else "wb") as f, tqdm(
            total=total, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=part.name[:-5]
        ) as bar:
            for block in iter(lambda: resp.read(1 << 20), b""):
                f.write(block)
                bar.update(len(block))
    if total is not None and part.stat().st_size != total:
        raise OSError(f"the connection closed after {part.stat().st_size} of {total} bytes")


def download(archive: Archive, folder: Path) -> Path:
    """The archive in `folder`, downloaded (resumably) and verified if not there yet.

    The final name appears only after the checksum matched, so a file under
    that name needs no second check.
    """
    final = folder / archive.filename
    if final.exists():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / (archive.filename + ".part")
    errors = []
    for url in archive.urls:
        log(f"downloading {url} -> {part}")
        try:
            _fetch(url, part)
            break
        except (OSError, http.client.HTTPException) as e:  # URLError, HTTPError, timeouts are OSErrors
            errors.append(f"{url}: {e}")
    else:
        fail(f"could not download {archive.filename} ({'; '.join(errors)}); rerun to resume, "
             f"or fetch it by hand into a folder and pass --raw FOLDER")
    mismatch = checksum_matches(part, archive)
    if mismatch:
        part.unlink()
        fail(f"downloaded {archive.filename} is corrupt ({mismatch}); removed it, rerun to download it again")
    part.rename(final)
    return final


def _wanted(name: str, members: Sequence[str]) -> bool:
    name = name[2:] if name.startswith("./") else name
    return any(name == m or (m.endswith("/") and name.startswith(m)) for m in members)


def extract(path: Path, members: Sequence[str], out: Path) -> None:
    """Extract `members` (files, or folders ending in "/") of a .tgz/.tar/.zip into `out`."""
    found = set()
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                for name in zf.namelist():
                    if _wanted(name, members):
                        zf.extract(name, out)
                        found.add(name)
        else:
            with tarfile.open(path) as tf:
                for info in tf:
                    if (info.isfile() or info.isdir()) and _wanted(info.name, members):
                        # the "data" filter refuses absolute paths and links out of `out`
                        tf.extract(info, out, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
                        found.add(info.name[2:] if info.name.startswith("./") else info.name)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile) as e:
        fail(f"cannot read {path} ({e}); delete it and rerun")
    for m in members:
        if not any(f == m.rstrip("/") or (m.endswith("/") and f.startswith(m)) for f in found):
            fail(f"{path} has no {m}: is it the right archive? delete it and rerun")


def _locate_extracted(raw: Path, member: str) -> Optional[Path]:
    """A member already extracted into raw: at its path in the archive, or under a shorter tail of it."""
    parts = Path(member.rstrip("/")).parts
    for i in range(len(parts)):
        candidate = raw.joinpath(*parts[i:])
        if candidate.exists():
            return candidate
    return None


def in_raw(archive: Archive, raw: Optional[Path]) -> Optional[Dict[str, Path]]:
    """The archive's members already extracted into --raw, or None when one is not there."""
    if raw is None:
        return None
    hits = {m: _locate_extracted(raw, m) for m in archive.members}
    return hits if all(hits.values()) else None


def describe_sources(archives: Sequence[Archive], raw: Optional[Path]) -> Dict[str, object]:
    """What the dataset is made from, for the done markers, without downloading
    anything: each file read in place from --raw by its identity(), each
    archive by its checksum (it is verified before use, so that names its content)."""
    sources = {}
    for archive in archives:
        found = in_raw(archive, raw)
        if found is None:
            sources[archive.filename] = archive.checksum
        else:
            sources.update({m: identity(p) for m, p in found.items()})
    return sources


def gather_inputs(archives: Sequence[Archive], raw: Optional[Path], work: Path) -> Dict[str, Path]:
    """Map every member of every archive to a readable path.

    With --raw, files already extracted there are used in place (nothing to
    check them against); otherwise the archive, from --raw or downloaded, is
    verified and its members extracted into work/extracted/<archive>/.
    """
    paths = {}
    for archive in archives:
        found = in_raw(archive, raw)
        if found is not None:
            paths.update(found)
            continue
        if raw is not None:
            missing = next(m for m in archive.members if _locate_extracted(raw, m) is None)
            path = raw / archive.filename
            if archive.plain:
                fail(f"{raw} has no {missing}")
            if not path.is_file():
                fail(f"{raw} has neither {archive.filename} nor its file {missing}")
        else:
            path = download(archive, work / "downloads")
        if archive.plain:
            paths[archive.members[0]] = path
            continue

        def build(tmp: Path, path=path, archive=archive) -> None:
            # a downloaded archive was checked before it got its name
            if raw is not None and (mismatch := checksum_matches(path, archive)):
                fail(f"{path} is corrupt or partial ({mismatch}); delete it and download it again")
            log(f"extracting {path.name} ...")
            extract(path, archive.members, tmp)

        out = step(work / "extracted" / archive.filename, build, {"checksum": archive.checksum})
        paths.update({m: out / m.rstrip("/") for m in archive.members})
    return paths
