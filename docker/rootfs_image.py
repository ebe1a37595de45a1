#!/usr/bin/env python3
"""A root file system as a one-layer image archive that `docker load` reads, with its architecture.

  rootfs_image.py --layer LAYER.tar --arch arm64 --tag NAME:TAG [--comment TEXT] > image.tar

`docker import --platform` is ignored by Docker 20.10 engines that do not run in experimental
mode: the image is then labelled with the engine's own architecture (amd64 here), and a build
for linux/arm64 on it fails ("does not match the specified platform") or runs on the wrong
base. An image archive carries its configuration, architecture included, and `docker load`
keeps it, on any engine. Standard library only (it runs under the build host's python3).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
import time
from pathlib import Path
from typing import IO

ARCHITECTURES = {"amd64": "", "arm64": "v8"}  # Docker's names, with the variant it records


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def config(diff_id: str, arch: str, comment: str, created: str) -> bytes:
    document: dict[str, object] = {
        "architecture": arch,
        "os": "linux",
        "created": created,
        "config": {
            "Cmd": ["/bin/bash"],
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        },
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": created, "created_by": "rootfs_image.py", "comment": comment}],
    }
    if ARCHITECTURES[arch]:
        document["variant"] = ARCHITECTURES[arch]
    return json.dumps(document, sort_keys=True).encode()


def write_archive(out: IO[bytes], layer: Path, arch: str, tag: str, comment: str) -> str:
    """Write the archive to `out`; return the image ID (the configuration's sha256)."""
    diff_id = digest(layer)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    blob = config(diff_id, arch, comment, created)
    image_id = hashlib.sha256(blob).hexdigest()
    manifest = [
        {"Config": f"{image_id}.json", "RepoTags": [tag], "Layers": [f"{diff_id}/layer.tar"]}
    ]
    with tarfile.open(fileobj=out, mode="w|") as archive:
        for name, data in (
            (f"{image_id}.json", blob),
            ("manifest.json", json.dumps(manifest).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        archive.add(str(layer), arcname=f"{diff_id}/layer.tar")
    return image_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rootfs_image.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=Path, required=True, help="the root file system as a tar")
    parser.add_argument("--arch", required=True, help="amd64 or arm64")
    parser.add_argument("--tag", required=True)
    parser.add_argument("--comment", default="")
    args = parser.parse_args(argv)
    if args.arch not in ARCHITECTURES:
        print(f"rootfs_image.py: --arch must be amd64 or arm64, not {args.arch!r}", file=sys.stderr)
        return 2
    if not args.layer.is_file():
        print(f"rootfs_image.py: no layer file {args.layer}", file=sys.stderr)
        return 2
    image_id = write_archive(sys.stdout.buffer, args.layer, args.arch, args.tag, args.comment)
    print(f"{args.tag}: sha256:{image_id} ({args.arch})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
