"""The carries' archives: a tar in xz, compressed in segments, in parallel, and cached.

    python -m tests.e2e.archive extract ARCHIVE DIR   # on the GPU machine: run.sh unpack

`make e2e-pack` writes each archive (a release's tree, its MoE and KDA modules, the CuTe DSL's
Python part, the compiled packages) as a GNU tar whose members are grouped into segments. Each
segment is compressed on its own into one xz stream; the archive is those streams one after the
other and a last one that ends the tar. Concatenated xz streams are one .xz file to every
reader (`xz -d`, `tar -xJf`, Python's lzma), so the GPU machine needs nothing but Python's
standard library.

Segments make the pack fast on a small machine:
* a process pool compresses one segment per core, the largest first;
* each compressed segment is kept in .cache/e2e-pack/ under the sha256 of its tar bytes
  and the codec's settings: a pack whose inputs did not change compresses nothing, and a
  changed file recompresses only its segment (entries unused for KEEP_DAYS are removed);
* the codec suits the content. x86-64 ELF files (the CUDA modules, the DSL's MLIR library)
  go through xz's x86 branch filter first (2-4% smaller), in segments of their own; the
  rest (Python, headers, data) is ordered by suffix and file name, so that the copies of a
  header in two vendored trees sit side by side. Files are grouped up to SEGMENT_BYTES;
* and the archive: DENSE (-9, a 64 MiB dictionary: the repeats in FlashAttention-3's module
  lie far apart, 7.6 MiB against 10.6 with -6) for what must fit one carry, FAST (LZMA2's
  fast mode, with the same dictionary) for the compiled packages (the DSL's libraries, TileLang,
  z3), which travel in parts anyway: 13% larger, in a quarter of the time.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import multiprocessing
import os
import shutil
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "e2e-pack"
KEEP_DAYS = 30
SEGMENT_BYTES = 64 << 20  # members are grouped up to this; a larger member is a segment alone
Filters = list[dict[str, int]]


class Codec(NamedTuple):
    elf: Filters  # for x86-64 ELF files
    other: Filters


X86 = {"id": lzma.FILTER_X86}
DENSE = Codec(
    elf=[X86, {"id": lzma.FILTER_LZMA2, "preset": 9}],
    other=[{"id": lzma.FILTER_LZMA2, "preset": 9}],
)
FAST = Codec(
    elf=[X86, {"id": lzma.FILTER_LZMA2, "preset": 1, "dict_size": 64 << 20}],
    other=[{"id": lzma.FILTER_LZMA2, "preset": 6}],
)
# In every cache key: a change to how a segment's bytes are laid out must change it.
LAYOUT = "GNU tar members, mode 755 for .so else 644, no times or owners; one xz stream"
END = bytes(2 * tarfile.BLOCKSIZE)  # a tar ends with two zero blocks


def x86_elf(data: bytes) -> bool:
    return data[:4] == b"\x7fELF" and data[18:20] == b"\x3e\x00"  # e_machine EM_X86_64


def member(name: str, data: bytes) -> bytes:
    """One tar member: header, data, padding to the block."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o755 if name.endswith(".so") else 0o644
    header = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    return b"".join((header, data, bytes(-len(data) % tarfile.BLOCKSIZE)))


def segments(
    members: Iterable[tuple[str, bytes]], codec: Codec
) -> Iterator[tuple[Filters, list[str], bytes]]:
    """The archive's segments in order: filters, the names in it, its tar bytes."""
    elf: list[tuple[str, bytes]] = []
    other: list[tuple[str, bytes]] = []
    for name, data in members:
        (elf if x86_elf(data) else other).append((name, data))
    for filters, group in ((codec.elf, elf), (codec.other, other)):
        group.sort(key=_order, reverse=True)  # taken from the end: each file's data is let go
        names: list[str] = []
        chunks: list[bytes] = []
        size = 0
        while group:
            name, data = group.pop()
            if names and size + len(data) > SEGMENT_BYTES:
                yield filters, names, b"".join(chunks)
                names, chunks, size = [], [], 0
            names.append(name)
            chunks.append(member(name, data))
            size += len(data)
            del data
        if names:
            yield filters, names, b"".join(chunks)


def _order(item: tuple[str, bytes]) -> tuple[str, str, str]:
    path = PurePosixPath(item[0])
    return path.suffix, path.name, item[0]


def key(filters: Filters, raw: bytes) -> str:
    digest = hashlib.sha256(json.dumps([LAYOUT, filters], sort_keys=True).encode())
    digest.update(raw)
    return digest.hexdigest()


def _compress(raw: str, filters: Filters, out: str) -> tuple[int, float]:
    """In a worker: the segment `raw` as one xz stream at `out` (whole, or not at all)."""
    started = time.monotonic()
    data = Path(raw).read_bytes()
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)
    partial = Path(f"{out}.{os.getpid()}.partial")
    partial.write_bytes(packed)
    partial.replace(out)
    Path(raw).unlink()
    return len(packed), time.monotonic() - started


class Packer:
    """Writes archives: `write` queues one (its segments compress in the pool or come from
    the cache), `finish` waits for every segment, with progress, and writes the archives."""

    def __init__(self, cache: Path = CACHE, jobs: int = 0) -> None:
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self.jobs = jobs or len(os.sched_getaffinity(0))
        self._pool: ProcessPoolExecutor | None = None
        self._scratch = tempfile.TemporaryDirectory(prefix="e2e-pack-")
        self._archives: list[tuple[Path, list[str]]] = []
        self._queued: dict[str, Future[tuple[int, float]]] = {}
        self._lock = threading.Lock()
        self._started = time.monotonic()
        # segments written (and of them: found in the cache, compressed), their tar bytes
        # (and of those: compressed, of which done)
        self.stats = dict.fromkeys(
            ("segments", "cached", "compressed", "bytes", "compressed_bytes", "done_bytes"), 0
        )

    def __enter__(self) -> Packer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._scratch.cleanup()

    def write(
        self, members: Iterable[tuple[str, bytes]], archive: Path, codec: Codec = DENSE
    ) -> None:
        keys = []
        todo: list[tuple[int, str, Filters, str]] = []
        for filters, names, raw in segments(members, codec):
            digest = key(filters, raw)
            keys.append(digest)
            self.stats["segments"] += 1
            self.stats["bytes"] += len(raw)
            stored = self.cache / f"{digest}.xz"
            if digest in self._queued or any(digest == queued[1] for queued in todo):
                continue
            if stored.is_file():
                os.utime(stored)  # in use: kept by `prune`
                self.stats["cached"] += 1
                continue
            (Path(self._scratch.name) / f"{digest}.tar").write_bytes(raw)
            label = f"{archive.parent.name}/{archive.name} {names[0]}"
            label += f" and {len(names) - 1} more" if len(names) > 1 else ""
            todo.append((len(raw), digest, filters, label))
        for size, digest, filters, label in sorted(todo, key=lambda item: -item[0]):
            self._submit(digest, filters, size, label)  # the largest first: a short tail
        self._archives.append((archive, keys))

    def _submit(self, digest: str, filters: Filters, size: int, label: str) -> None:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")  # the workers hold no pack data
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=context)
        scratch = Path(self._scratch.name) / f"{digest}.tar"
        stored = self.cache / f"{digest}.xz"
        self.stats["compressed"] += 1
        self.stats["compressed_bytes"] += size
        future = self._pool.submit(_compress, str(scratch), filters, str(stored))
        self._queued[digest] = future

        def report(done: Future[tuple[int, float]]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            packed, seconds = done.result()
            with self._lock:
                self.stats["done_bytes"] += size
                print(
                    f"  xz {label}: {size / 2**20:.1f} MiB -> {packed / 2**20:.1f} MiB"
                    f" in {seconds:.0f} s ({self.stats['done_bytes'] >> 20} of"
                    f" {self.stats['compressed_bytes'] >> 20} MiB compressed,"
                    f" {time.monotonic() - self._started:.0f} s)",
                    flush=True,
                )

        future.add_done_callback(report)

    def finish(self) -> None:
        """Wait for the pool (a failed segment fails the pack), then write every archive."""
        stats = self.stats
        print(
            f"  {stats['segments']} segments ({stats['bytes'] >> 20} MiB of tar):"
            f" {stats['cached']} from {self.cache}, {stats['compressed']} to compress"
            + (f", {self.jobs} at a time" if stats["compressed"] else ""),
            flush=True,
        )
        try:
            for future in self._queued.values():
                future.result()
        except (BrokenProcessPool, OSError, MemoryError, lzma.LZMAError) as error:
            raise SystemExit(f"error: compressing a segment failed: {error!r}") from error
        for archive, keys in self._archives:
            partial = archive.with_name(archive.name + ".partial")
            with partial.open("wb") as out:
                for digest in keys:
                    with (self.cache / f"{digest}.xz").open("rb") as stored:
                        shutil.copyfileobj(stored, out)
                out.write(lzma.compress(END, format=lzma.FORMAT_XZ))
            partial.replace(archive)
        self._archives.clear()
        prune(self.cache)


def prune(cache: Path, days: int = KEEP_DAYS) -> None:
    """Remove what no pack used for `days` (and partial files of a pack that was killed)."""
    now = time.time()
    for path in cache.iterdir():
        age = now - path.stat().st_mtime
        if age > days * 86400 or (path.name.endswith(".partial") and age > 86400):
            path.unlink(missing_ok=True)


def extract(archive: Path, dest: Path) -> int:
    """Unpack `archive` into `dest`: 0, or 2 with the reason where it is damaged."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        # Random access ("r:"): the stream mode ("r|") reads the first xz stream only.
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(dest, filter="data")
    except (OSError, EOFError, lzma.LZMAError, tarfile.TarError) as error:
        print(f"error: {archive} cannot be unpacked: {error}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "extract":
        print("usage: python -m tests.e2e.archive extract ARCHIVE DIR", file=sys.stderr)
        return 2
    return extract(Path(argv[1]), Path(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
