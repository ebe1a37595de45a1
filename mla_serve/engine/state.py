"""The per-rank engine state file: written by the plugin, read by the sidecar.

One JSON file per engine rank, `rank-<global rank>.json` in the state directory
shared by the vLLM and sidecar containers, holding a `contract.RankRecord`.
Files are replaced atomically, so a reader never sees a half-written one. The
reader trusts nothing in that directory (another process, another container,
maybe another mla-serve release writes it): each file is checked against the
contract and a file that breaks it is refused, with the reason, not read in part.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mla_serve.engine import contract
from mla_serve.engine.contract import RankRecord

STATE_DIR_ENV = "MLA_SERVE_STATE_DIR"
MAX_BYTES = 1 << 20  # a rank file is about 1 KiB; anything this large is not one
_NAME = re.compile(r"rank-(0|[1-9][0-9]{0,8})\.json")


@dataclass(frozen=True)
class Refused:
    """A rank file the sidecar did not read, and why."""

    file: str
    reason: str


@dataclass(frozen=True)
class Reading:
    records: list[RankRecord]  # ordered by rank
    refused: list[Refused]  # ordered by file name


def path_for(state_dir: Path, rank: int) -> Path:
    return state_dir / f"rank-{rank}.json"


def write(state_dir: Path, record: RankRecord) -> Path:
    """Atomically replace this rank's state file."""
    document = contract.encode(record)  # raises, before any write, on a record off contract
    state_dir.mkdir(parents=True, exist_ok=True)
    target = path_for(state_dir, record.rank)
    descriptor, temporary = tempfile.mkstemp(dir=state_dir, prefix=".rank-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2, sort_keys=True)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target


def read_all(state_dir: Path) -> Reading:
    """Every rank file that keeps the contract, and every other one with its reason."""
    records: list[RankRecord] = []
    refused: list[Refused] = []
    for path in sorted(state_dir.glob("rank-*.json")):
        try:
            records.append(_read(path))
        except FileNotFoundError:
            continue  # replaced or removed since the listing: not a problem of the file
        except (OSError, ValueError) as error:  # ContractError is a ValueError
            refused.append(Refused(path.name, str(error)))
    return Reading(sorted(records, key=lambda record: record.rank), refused)


def _read(path: Path) -> RankRecord:
    name = _NAME.fullmatch(path.name)
    if name is None:
        raise ValueError("not a rank file name (rank-<n>.json)")
    data = _bounded_read(path)
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError, json.JSONDecodeError) as error:
        raise ValueError(f"not JSON: {error}") from None
    record = contract.decode(document)
    if record.rank != int(name.group(1)):
        raise ValueError(f"holds rank {record.rank} under the name of rank {name.group(1)}")
    return record


def _bounded_read(path: Path) -> bytes:
    """A regular file's bytes, at most MAX_BYTES. Opened non-blocking: a FIFO under that
    name must not hang the reader."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError("not a regular file")
        data = os.read(descriptor, min(status.st_size, MAX_BYTES) + 1)
        while len(data) <= MAX_BYTES and (more := os.read(descriptor, MAX_BYTES + 1 - len(data))):
            data += more  # grown since the stat, or a short read
    finally:
        os.close(descriptor)
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    return data
