"""An archive too big for one carry, in parts: `split` here, `join` on the GPU machine.

    python -m tests.e2e.parts join PARTS_DIR ARCHIVE   # exit 0: joined and checked;
                                                       # 3: parts still missing

`make e2e-pack` cuts the compiled packages of a CuTe DSL version (the DSL's compiled part,
TileLang, z3: about 110 MB of xz) into as few parts of equal size as fit the room a carry leaves
beside the repository (`pack.room`), each a carry of its own (`deps-<version>-part<i>/`);
`run.sh unpack` collects them and joins them once all are there, checking the whole archive's
sha256.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def split(archive: Path, out: Path, stem: str, most: int) -> list[Path]:
    """`archive` as parts of at most `most` bytes, as even as may be, in `out/<stem>-part<i>/`,
    each with the part and parts.json."""
    data = archive.read_bytes()
    count = max(1, -(-len(data) // most))
    size = -(-len(data) // count)
    meta = {"archive": archive.name, "sha256": hashlib.sha256(data).hexdigest(), "parts": count}
    folders = []
    for index in range(count):
        folder = out / f"{stem}-part{index + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f"{archive.name}.*"):
            stale.unlink()
        chunk = data[index * size : (index + 1) * size]
        (folder / f"{archive.name}.{index + 1}").write_bytes(chunk)
        (folder / "parts.json").write_text(json.dumps(meta | {"part": index + 1}) + "\n")
        folders.append(folder)
    return folders


def join(parts: Path, archive: Path) -> int:
    meta = json.loads((parts / "parts.json").read_text())
    pieces = [parts / f"{meta['archive']}.{i}" for i in range(1, meta["parts"] + 1)]
    missing = [piece.name for piece in pieces if not piece.is_file()]
    if missing:
        print(f"{parts}: waiting for {', '.join(missing)}")
        return 3
    data = b"".join(piece.read_bytes() for piece in pieces)
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        print(f"error: the joined {meta['archive']} does not match its sha256", file=sys.stderr)
        return 2
    archive.write_bytes(data)
    for piece in pieces:
        piece.unlink()
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "join":
        print("usage: python -m tests.e2e.parts join PARTS_DIR ARCHIVE", file=sys.stderr)
        return 2
    return join(Path(argv[1]), Path(argv[2]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
