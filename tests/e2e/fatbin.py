"""Keep one GPU architecture's device code in a CUDA extension module, zero the rest.

vLLM's wheels carry machine code for every GPU generation (sm_75 … sm_120) plus
PTX, which makes `_C` 93 MB; a device run carries at most 64 MiB. The H200
(sm_90) loads only the sm_90 cubins, or, for a kernel that has none, PTX of an
architecture at or below 90. So every other entry's payload is overwritten with
zeros in place: the ELF file keeps its size, layout and symbols, the CUDA
driver still parses every fatbin header, and the zeros compress to nothing
(`_C`: 64 MB → 16 MB with xz).

Layout (CUDA's fatbinary.h): the `.nv_fatbin` section holds fatbins, each a
16-byte header (magic 0xBA55ED50, version, header size, size of the entries)
and entries, each a header (kind 1 = PTX, 2 = ELF cubin; header size; payload
size; the architecture at byte 28) followed by its payload.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

FATBIN_MAGIC = 0xBA55ED50
PTX, CUBIN = 1, 2


class FatbinError(Exception):
    """Not an ELF file with a parsable .nv_fatbin section."""


@dataclass(frozen=True)
class Entry:
    kind: int  # PTX or CUBIN
    arch: int  # e.g. 90 for sm_90 / compute_90
    offset: int  # of the payload in the file
    size: int


def prune(data: bytes, arch: int) -> tuple[bytes, int]:
    """`data` with every entry zeroed that a GPU of `arch` does not load; and the bytes zeroed.

    Per fatbin: cubins of other architectures go; PTX goes when a cubin of
    `arch` exists (the driver prefers it) or when its architecture is above `arch`.
    """
    out = bytearray(data)
    zeroed = 0
    for entries in fatbins(data):
        has_cubin = any(e.kind == CUBIN and e.arch == arch for e in entries)
        for entry in entries:
            drop = (entry.kind == CUBIN and entry.arch != arch) or (
                entry.kind == PTX and (has_cubin or entry.arch > arch)
            )
            if drop:
                out[entry.offset : entry.offset + entry.size] = bytes(entry.size)
                zeroed += entry.size
    return bytes(out), zeroed


def architectures(data: bytes) -> dict[tuple[int, int], int]:
    """Payload bytes per (kind, arch): what a module carries, for the pack report."""
    sizes: dict[tuple[int, int], int] = {}
    for entries in fatbins(data):
        for entry in entries:
            key = (entry.kind, entry.arch)
            sizes[key] = sizes.get(key, 0) + entry.size
    return sizes


def fatbins(data: bytes) -> Iterator[list[Entry]]:
    section = _section(data, ".nv_fatbin")
    if section is None:
        return  # host code only (e.g. DeepGEMM, which compiles its kernels at run time)
    offset, end = section
    while offset + 16 <= end:
        magic, _, header, size = struct.unpack_from("<IHHQ", data, offset)
        if magic != FATBIN_MAGIC:
            offset += 8  # fatbins are 8-byte aligned, with padding between them
            continue
        entry, stop, entries = offset + header, offset + header + size, []
        while entry < stop:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (entry_arch,) = struct.unpack_from("<I", data, entry + 28)
            if kind not in (PTX, CUBIN) or entry_header == 0:
                raise FatbinError(f"unexpected fatbin entry kind {kind} at byte {entry}")
            entries.append(Entry(kind, entry_arch, entry + entry_header, payload))
            entry += entry_header + payload
        yield entries
        offset = stop


def _section(data: bytes, wanted: str) -> tuple[int, int] | None:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise FatbinError("not a 64-bit ELF file")
    (table,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, table + i * entry_size) for i in range(count)]
    names = headers[names_index][4]
    for name_offset, _, _, _, offset, size in headers:
        end = data.index(b"\0", names + name_offset)
        if data[names + name_offset : end].decode() == wanted:
            return offset, offset + size
    return None
