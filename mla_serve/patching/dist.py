"""A patched vLLM wheel: the release's own wheel with the fix series applied, for `pip install`.

`build` reads a released vLLM wheel, applies the release's series with the patch engine
(the same plan, compile check and probes as `patches apply`, on the wheel's Python code
unpacked into a temporary directory) and writes a new wheel:

- version `<release>+mla.<series digest, 12 hex>` (PEP 440 local version; a local label the
  source already has is kept in front: `0.33.0+cu130.mla.<digest>`), in the file name, in
  METADATA's `Version:` and in the `.dist-info` (and `.data`) folder names;
- the files the series changes, with `vllm/mla_serve_manifest.json` (the manifest that
  `mla-serve patches verify` reads on the installed tree) added;
- every other member copied as its compressed bytes, unread: byte-identical, with its CRC,
  time and mode (memory stays bounded however large the wheel is);
- RECORD rewritten: new sha256 and size for every changed or added file, every row renamed
  with the `.dist-info` folder; the WHEEL file and the file name's tags kept as they are.

Rewritten members are stored uncompressed and dated like the members they replace, so the
same source wheel, series and mla-serve give the same bytes, whatever zlib is installed.

`check` is the verifier: it reads every member and compares it with RECORD (pip itself does
not compare a wheel's RECORD hashes when it installs it), and checks the version, the
folder names and the manifest's series digest against the local version label.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import io
import json
import os
import re
import struct
import tempfile
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from mla_serve.patching import engine, manifest, tree, wheel
from mla_serve.patching.catalog import Catalog

LABEL = "mla"
DIGEST_CHARS = 12
MANIFEST_MEMBER = f"vllm/{manifest.FILENAME}"
CHUNK = 1 << 20

# The ZIP records this writer emits (APPNOTE.TXT 4.3.7, 4.3.12, 4.3.16); no ZIP64.
_LOCAL = struct.Struct("<4s2B4HL2L2H")
_CENTRAL = struct.Struct("<4s4B4HL2L5H2L")
_END = struct.Struct("<4s4H2LH")
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_ZIP32_MAX = 0xFFFFFFFF
_UTF8_FLAG, _DESCRIPTOR_FLAG, _ENCRYPTED_FLAG = 0x800, 0x08, 0x01


class DistError(Exception):
    """The wheel cannot be built or read; nothing was written."""


@dataclass(frozen=True)
class WheelName:
    """`{distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl`."""

    distribution: str
    version: str
    build: str | None
    tags: str  # python-abi-platform, as in the file name

    @classmethod
    def parse(cls, name: str) -> WheelName:
        parts = name.removesuffix(".whl").split("-") if name.endswith(".whl") else []
        if len(parts) not in (5, 6) or not all(parts):
            raise DistError(f"{name} is not a wheel file name (name-version-python-abi-platform)")
        build = parts[2] if len(parts) == 6 else None
        return cls(parts[0], parts[1], build, "-".join(parts[-3:]))

    def filename(self, version: str | None = None) -> str:
        build = [self.build] if self.build else []
        return "-".join([self.distribution, version or self.version, *build, self.tags]) + ".whl"

    def folder(self, kind: str, version: str | None = None) -> str:
        """The `.dist-info` or `.data` folder of this wheel (with another version if given)."""
        return f"{self.distribution}-{version or self.version}.{kind}"


def local_version(version: str, digest: str) -> str:
    """`version` with `mla.<digest prefix>` appended to its PEP 440 local label.

    The label is written in PEP 440's normal form, so the file name, METADATA and what
    pip reports agree: an all-digit prefix is a number there and loses its leading zeros.
    """
    base, _, label = version.partition("+")
    if LABEL in label.split("."):
        raise DistError(f"vLLM {version} is already an mla-serve build (local label {label!r})")
    return f"{base}+{label + '.' if label else ''}{LABEL}.{_segment(digest)}"


def _segment(digest: str) -> str:
    """The version's label segment for a series digest."""
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise DistError(f"series digest {digest!r} is not a sha256 hex digest")
    prefix = digest[:DIGEST_CHARS]
    return str(int(prefix)) if prefix.isdigit() else prefix


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


@dataclass(frozen=True)
class Built:
    path: Path
    version: str
    release: str
    digest: str  # the series digest
    states: list[engine.FixState]
    changed: list[str]  # tree files the series changed in the wheel (manifest not counted)
    checked: int  # members whose bytes `check` compared with RECORD
    sha256: str  # of the wheel file (for pip's --require-hashes)


# --- building -----------------------------------------------------------------------


def build(
    source: Path,
    out_dir: Path,
    catalog: Catalog,
    *,
    progress: Callable[[str], None] = lambda line: None,
) -> Built:
    """Write the patched wheel of `source` into `out_dir` and check it; its path and facts.

    All or nothing: the wheel is written under a temporary name, checked with `check`,
    and renamed into place only when it passes.
    """
    name = WheelName.parse(source.name)
    if name.distribution != "vllm":
        raise DistError(f"{source.name} is not a vLLM wheel")
    local_version(name.version, "0" * 64)  # refuses an mla-serve build before any work
    try:
        with zipfile.ZipFile(source) as archive:
            layout = _Layout.read(archive, name)
    except (OSError, zipfile.BadZipFile) as error:
        raise DistError(f"cannot read {source}: {_reason(error)}") from None
    if MANIFEST_MEMBER in layout.names:
        raise DistError(f"{source.name} already contains {MANIFEST_MEMBER}")
    writable(out_dir)  # before the unpacking and patching, not after
    with tempfile.TemporaryDirectory(prefix="mla-serve-wheel.") as scratch:
        root = Path(scratch) / "tree"
        wheel.unpack(source, root, python_only=True, progress=progress)
        found = tree.locate(root)
        release = catalog.release_of(found.version)
        if catalog.release_of(name.version) != release:
            raise DistError(f"{source.name} holds vLLM {found.version}, not {name.version}")
        plan = engine.plan(found, catalog)
        states = engine.check(plan, catalog)
        document = manifest.build(plan, states)
        changes = {path: _encoded(text) for path, text in plan.changes.items()}
    version = local_version(name.version, plan.series.digest)
    changes[MANIFEST_MEMBER] = manifest.render(document).encode()
    target = out_dir / name.filename(version)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=out_dir)
        os.close(handle)
    except OSError as error:
        raise DistError(f"cannot write into {out_dir}: {_reason(error)}") from None
    partial = Path(temporary)
    try:
        digest = rewrite(source, partial, name, version, changes, layout)
        problems, checked = check(partial, name=target.name, progress=progress)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise DistError(f"the written wheel fails its own check: {problems[0]}{more}")
        partial.chmod(0o644)
        partial.replace(target)
    except OSError as error:
        partial.unlink(missing_ok=True)
        raise DistError(f"cannot write {target}: {_reason(error)}") from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    changed = sorted(p for p in changes if p != MANIFEST_MEMBER)
    return Built(target, version, release, plan.series.digest, states, changed, checked, digest)


def writable(out_dir: Path) -> None:
    """Create `out_dir` if needed and make sure a file can be created in it; DistError if not."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        raise DistError(f"cannot write into {out_dir}: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    return str(getattr(error, "strerror", None) or error)


def _encoded(text: str | None) -> bytes | None:
    return None if text is None else text.encode("utf-8")


@dataclass(frozen=True)
class _Layout:
    """What `rewrite` needs from the source wheel besides its members' bytes."""

    infos: list[zipfile.ZipInfo]
    names: set[str]
    metadata: bytes
    record: dict[str, tuple[str, str]]  # path -> (hash, size), RECORD's own row left out

    @classmethod
    def read(cls, archive: zipfile.ZipFile, name: WheelName) -> _Layout:
        infos = [i for i in archive.infolist() if not i.is_dir()]
        names = {i.filename for i in infos}
        if len(names) != len(infos):
            raise DistError(f"{name.filename()} names a member twice")
        for info in infos:
            if info.flag_bits & _ENCRYPTED_FLAG:
                raise DistError(f"{name.filename()}: {info.filename} is encrypted")
            if max(info.file_size, info.compress_size, info.header_offset) >= _ZIP32_MAX:
                raise DistError(f"{name.filename()} needs ZIP64, which this writer does not write")
        info_dir = name.folder("dist-info")
        folders = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        if folders != {info_dir}:
            found = ", ".join(sorted(folders)) or "none"
            raise DistError(f"{name.filename()} should have one {info_dir} folder, has {found}")
        for required in ("METADATA", "WHEEL", "RECORD"):
            if f"{info_dir}/{required}" not in names:
                raise DistError(f"{name.filename()} has no {info_dir}/{required}")
        rows = _record_rows(archive.read(f"{info_dir}/RECORD"), f"{info_dir}/RECORD")
        record_name = f"{info_dir}/RECORD"
        record = {path: (digest, size) for path, digest, size in rows if path != record_name}
        missing = sorted(names - set(record) - {record_name})
        if missing:
            raise DistError(f"{name.filename()}: RECORD does not list {missing[0]}")
        absent = sorted(set(record) - names)
        if absent:
            raise DistError(f"{name.filename()}: RECORD lists {absent[0]}, which it does not hold")
        metadata = archive.read(f"{info_dir}/METADATA")
        return cls(infos, names, metadata, record)


def rewrite(
    source: Path,
    dest: Path,
    name: WheelName,
    version: str,
    changes: dict[str, bytes | None],
    layout: _Layout | None = None,
) -> str:
    """Write `source` as the wheel of `version` into `dest`, with `changes` applied; the
    sha256 of what was written.

    `changes` maps member paths to their new bytes (None: remove the member); paths the
    source lacks are added before the `.dist-info` folder, in name order. The RECORD is
    rebuilt from the source's rows and the new bytes; nothing else is checked here.
    """
    with zipfile.ZipFile(source) as archive:
        layout = layout or _Layout.read(archive, name)
    renames = {name.folder(kind): name.folder(kind, version) for kind in ("dist-info", "data")}
    info_dir = renames[name.folder("dist-info")]

    def renamed(path: str) -> str:
        head, sep, rest = path.partition("/")
        return renames.get(head, head) + sep + rest

    old_dir = name.folder("dist-info")
    changes = dict(changes)
    changes[f"{old_dir}/METADATA"] = _with_version(layout.metadata, name.version, version)
    record_member = next(i for i in layout.infos if i.filename == f"{old_dir}/RECORD")
    added = sorted(p for p in changes if p not in layout.names and changes[p] is not None)
    rows: list[tuple[str, str, str]] = []
    with source.open("rb") as raw, _ZipWriter(dest) as out:
        placed = False
        for info in layout.infos:
            if info is record_member:
                continue
            if not placed and info.filename.startswith(old_dir + "/"):
                placed = True
                rows += _add_new(out, added, changes, record_member)
            if info.filename in changes:
                data = changes[info.filename]
                if data is None:
                    continue
                out.add(renamed(info.filename), data, info.date_time, info.external_attr)
                rows.append((renamed(info.filename), record_hash(data), str(len(data))))
            else:
                out.copy(raw, info, renamed(info.filename))
                digest, size = layout.record[info.filename]
                rows.append((renamed(info.filename), digest, size))
        if not placed:
            rows += _add_new(out, added, changes, record_member)
        record = f"{info_dir}/RECORD"
        rows.append((record, "", ""))
        out.add(record, _record_bytes(rows), record_member.date_time, record_member.external_attr)
    return out.sha256


def _add_new(
    out: _ZipWriter, added: list[str], changes: dict[str, bytes | None], like: zipfile.ZipInfo
) -> list[tuple[str, str, str]]:
    rows = []
    for path in added:
        data = changes[path]
        assert data is not None
        out.add(path, data, like.date_time, (0o100644 << 16))
        rows.append((path, record_hash(data), str(len(data))))
    return rows


def _with_version(metadata: bytes, old: str, new: str) -> bytes:
    """METADATA with its `Version:` header (in the header block, before the body) replaced."""
    lines = metadata.splitlines(keepends=True)
    for index, line in enumerate(lines):
        if not line.strip():
            break  # the body (the long description) starts after the first blank line
        if line.startswith(b"Version:"):
            value = line.split(b":", 1)[1].strip().decode("utf-8", "replace")
            if value != old:
                raise DistError(f"METADATA says Version: {value}, the file name says {old}")
            ending = line[len(line.rstrip(b"\r\n")) :]
            lines[index] = f"Version: {new}".encode() + ending
            return b"".join(lines)
    raise DistError("METADATA has no Version: header")


def _record_rows(data: bytes, where: str) -> list[tuple[str, str, str]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise DistError(f"{where} is not UTF-8") from None
    rows = []
    for number, row in enumerate(csv.reader(io.StringIO(text)), 1):
        if not row:
            continue
        if len(row) != 3:
            raise DistError(f"{where} line {number}: {len(row)} fields, not path,hash,size")
        rows.append((row[0], row[1], row[2]))
    return rows


def _record_bytes(rows: list[tuple[str, str, str]]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerows(rows)
    return text.getvalue().encode("utf-8")


class _ZipWriter:
    """A ZIP archive written member by member: raw copies of another archive's members
    (compressed bytes unread) and new members stored uncompressed."""

    def __init__(self, path: Path) -> None:
        self._file: IO[bytes] = path.open("wb")
        self._central: list[bytes] = []
        self._digest = hashlib.sha256()  # of the whole archive, as it is written

    @property
    def sha256(self) -> str:
        return self._digest.hexdigest()

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._digest.update(data)

    def __enter__(self) -> _ZipWriter:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        try:
            if kind is None:
                self._finish()
        finally:
            self._file.close()

    def copy(self, source: IO[bytes], info: zipfile.ZipInfo, name: str) -> None:
        source.seek(info.header_offset)
        header = source.read(_LOCAL.size)
        if len(header) != _LOCAL.size or header[:4] != _LOCAL_SIG:
            raise DistError(f"{info.filename}: no local file header at {info.header_offset}")
        fields = _LOCAL.unpack(header)
        source.seek(info.header_offset + _LOCAL.size + fields[-2] + fields[-1])
        self._header(
            _Entry(
                name,
                flags=info.flag_bits & ~_DESCRIPTOR_FLAG,  # sizes go into the header
                method=info.compress_type,
                date_time=info.date_time,
                crc=info.CRC,
                compressed=info.compress_size,
                size=info.file_size,
                made_by=(info.create_version, info.create_system),
                needed=max(info.extract_version, 20),
                internal_attr=info.internal_attr,
                external_attr=info.external_attr,
            )
        )
        left = info.compress_size
        while left:
            block = source.read(min(left, CHUNK))
            if not block:
                raise DistError(f"{info.filename}: the archive ends inside its data")
            self._write(block)
            left -= len(block)

    def add(self, name: str, data: bytes, date_time: tuple[int, ...], external_attr: int) -> None:
        """A member stored uncompressed, made on Unix (so its mode is kept)."""
        self._header(
            _Entry(
                name,
                flags=0,
                method=zipfile.ZIP_STORED,
                date_time=date_time,
                crc=binascii.crc32(data),
                compressed=len(data),
                size=len(data),
                made_by=(20, 3),
                needed=20,
                internal_attr=0,
                external_attr=external_attr,
            )
        )
        self._write(data)

    def _header(self, entry: _Entry) -> None:
        offset = self._file.tell()
        flags = entry.flags
        try:
            encoded = entry.name.encode("ascii")
            flags &= ~_UTF8_FLAG
        except UnicodeEncodeError:
            encoded = entry.name.encode("utf-8")
            flags |= _UTF8_FLAG
        if max(offset, entry.compressed, entry.size) >= _ZIP32_MAX:
            raise DistError("the patched wheel would need ZIP64, which this writer does not write")
        year, month, day, hour, minute, second = entry.date_time
        dos_date = (year - 1980) << 9 | month << 5 | day
        dos_time = hour << 11 | minute << 5 | second // 2
        common = (
            flags, entry.method, dos_time, dos_date, entry.crc, entry.compressed, entry.size,
            len(encoded), 0,
        )  # fmt: skip
        self._write(_LOCAL.pack(_LOCAL_SIG, entry.needed, 0, *common) + encoded)
        self._central.append(
            _CENTRAL.pack(
                _CENTRAL_SIG,
                *entry.made_by,
                entry.needed,
                0,
                *common,
                0,
                0,
                entry.internal_attr,
                entry.external_attr,
                offset,
            )
            + encoded
        )

    def _finish(self) -> None:
        start = self._file.tell()
        for entry in self._central:
            self._write(entry)
        size = self._file.tell() - start
        count = len(self._central)
        if count > 0xFFFF or start + size >= _ZIP32_MAX:
            raise DistError("the patched wheel would need ZIP64, which this writer does not write")
        self._write(_END.pack(_END_SIG, 0, 0, count, count, size, start, 0))
        self._file.flush()
        os.fsync(self._file.fileno())


@dataclass(frozen=True)
class _Entry:
    """One member's header fields (local header and central directory entry)."""

    name: str
    flags: int
    method: int
    date_time: tuple[int, ...]
    crc: int
    compressed: int
    size: int
    made_by: tuple[int, int]  # (version, system)
    needed: int
    internal_attr: int
    external_attr: int


# --- checking -------------------------------------------------------------------------


def check(
    path: Path, *, name: str | None = None, progress: Callable[[str], None] = lambda line: None
) -> tuple[list[str], int]:
    """What is wrong with the wheel at `path` (empty: nothing), and how many members were read.

    Every member is read and compared with its RECORD row (sha256 and size); every member
    must have a row and every row a member; the `.dist-info` folder, METADATA's Version and
    the file name must agree; an mla-serve build (`+…mla.<digest>`) must carry the manifest
    of that series digest. `name` is the file name to judge (default: the path's).
    """
    wheel_name = WheelName.parse(name or path.name)
    try:
        handle = path.open("rb")
    except OSError as error:  # no wheel to judge: bad input, not a bad wheel
        raise DistError(f"cannot read {path}: {_reason(error)}") from None
    try:
        with handle, zipfile.ZipFile(handle) as archive:
            return _check(archive, path, wheel_name, progress)
    except (OSError, zipfile.BadZipFile) as error:
        return [f"cannot read {path.name} as a ZIP archive: {error}"], 0


def _check(
    archive: zipfile.ZipFile, path: Path, name: WheelName, progress: Callable[[str], None]
) -> tuple[list[str], int]:
    problems: list[str] = []
    infos = [i for i in archive.infolist() if not i.is_dir()]
    info_dir = name.folder("dist-info")
    record_name = f"{info_dir}/RECORD"
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        problems.append("a member name occurs twice")
    folders = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
    if folders != {info_dir}:
        problems.append(f"the .dist-info folder is {sorted(folders)}, not {info_dir}")
    if record_name not in names:
        return [*problems, f"no {record_name}"], 0
    try:
        rows = _record_rows(archive.read(record_name), record_name)
    except DistError as error:
        return [*problems, str(error)], 0
    record: dict[str, tuple[str, str]] = {}
    for member, digest, size in rows:
        if member in record:
            problems.append(f"RECORD lists {member} twice")
        record[member] = (digest, size)
    problems += _check_metadata(archive, name, names)
    listed = [i for i in infos if i.filename in record and i.filename != record_name]
    hashes = _hash_members(path, listed, name, progress)
    for info in infos:
        row = record.get(info.filename)
        if row is None:
            problems.append(f"{info.filename}: not in RECORD")
            continue
        if info.filename == record_name:
            continue
        digest, size = row
        found = hashes[info.filename]
        if isinstance(found, str):
            problems.append(f"{info.filename}: cannot be read ({found})")
            continue
        actual, length = found
        if not digest.startswith("sha256="):
            problems.append(f"{info.filename}: RECORD gives no sha256 ({digest or 'empty'})")
        elif actual != digest:
            problems.append(f"{info.filename}: {actual}, RECORD says {digest}")
        if str(length) != size:
            problems.append(f"{info.filename}: {length} bytes, RECORD says {size or 'nothing'}")
    for missing in sorted(set(record) - set(names)):
        problems.append(f"{missing}: in RECORD but not in the wheel")
    return problems, len(listed)


def _hash_members(
    path: Path, infos: list[zipfile.ZipInfo], name: WheelName, progress: Callable[[str], None]
) -> dict[str, tuple[str, int] | str]:
    """RECORD's hash and the length of each member, or why it cannot be read.

    Members are read by a few threads, each with its own handle on the file, largest
    first (zlib and hashlib release the GIL): a third of the time on four cores.
    """
    handles = threading.local()
    opened: list[zipfile.ZipFile] = []

    def one(info: zipfile.ZipInfo) -> tuple[str, int] | str:
        archive = getattr(handles, "archive", None)
        if archive is None:
            archive = handles.archive = zipfile.ZipFile(path)
            opened.append(archive)
        try:
            return _member_hash(archive, info)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as error:
            return str(error)

    order = sorted(infos, key=lambda i: -i.compress_size)
    results: dict[str, tuple[str, int] | str] = {}
    total, done, shown = sum(i.compress_size for i in infos) or 1, 0, 0
    try:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            for info, result in zip(order, pool.map(one, order), strict=True):
                results[info.filename] = result
                done += info.compress_size
                if 100 * done // total >= shown + 10:
                    shown = 100 * done // total // 10 * 10
                    progress(f"checking {name.filename()}: {shown}%")
    finally:
        for archive in opened:
            archive.close()
    return results


def _member_hash(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[str, int]:
    """RECORD's hash of a member and its length, read in chunks (zipfile checks its CRC)."""
    digest = hashlib.sha256()
    length = 0
    with archive.open(info) as member:
        while block := member.read(CHUNK):
            digest.update(block)
            length += len(block)
    encoded = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode("ascii")
    return "sha256=" + encoded, length


def _check_metadata(archive: zipfile.ZipFile, name: WheelName, names: Iterable[str]) -> list[str]:
    problems = []
    info_dir = name.folder("dist-info")
    present = set(names)
    for required in ("METADATA", "WHEEL"):
        if f"{info_dir}/{required}" not in present:
            problems.append(f"no {info_dir}/{required}")
    if f"{info_dir}/METADATA" in present:
        headers = _headers(archive.read(f"{info_dir}/METADATA"))
        if headers.get("Version") != name.version:
            problems.append(
                f"METADATA says Version: {headers.get('Version')}, the file name {name.version}"
            )
        if (headers.get("Name") or "").lower() != name.distribution.lower():
            problems.append(f"METADATA says Name: {headers.get('Name')}")
    label = name.version.partition("+")[2].split(".")
    if LABEL in label:
        problems += _check_manifest(archive, label[label.index(LABEL) + 1 :], present)
    return problems


def _check_manifest(archive: zipfile.ZipFile, tail: list[str], present: set[str]) -> list[str]:
    if MANIFEST_MEMBER not in present:
        return [f"an mla-serve build without {MANIFEST_MEMBER}"]
    try:
        document: Any = json.loads(archive.read(MANIFEST_MEMBER))
        digest = str(document["series"]["digest"])
    except (ValueError, KeyError, TypeError) as error:
        return [f"{MANIFEST_MEMBER} is not an mla-serve manifest ({error})"]
    try:
        expected = _segment(digest)
    except DistError as error:
        return [f"{MANIFEST_MEMBER}: {error}"]
    if tail != [expected]:
        return [f"the version's label says mla.{'.'.join(tail)}, the manifest's series {expected}"]
    return []


def _headers(metadata: bytes) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in metadata.decode("utf-8", "replace").splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and not line[0].isspace():
            headers.setdefault(key.strip(), value.strip())
    return headers
