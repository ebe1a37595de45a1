"""`make e2e-pack`: everything the end-to-end run needs on the GPU machine, in one carry.

build/e2e-pack/
  vllm.tar.xz  the release's tree from its wheel: the Python package, its data,
               DeepGEMM's JIT headers, and the CUDA extension modules the
               sparse-MLA path loads on Hopper, each pruned to sm_90 device code
               (fatbin.py). Left out: the Rust frontend binary (opt-in), and the
               modules of paths this model does not take (FlashAttention-2, MoE,
               SM100's DeepSelect, FlashKDA, QuTLASS)
  wheels/      light cp312 wheels of tests/e2e/wheels.txt, and mla-serve's own
               wheel (its `vllm.general_plugins` entry point loads the plugin)
  model/       the tiny DeepSeek-V3.2 model (model.py)
  pack.json    release, sizes, and the device code each module kept

A device run carries the repository and the pack together, at most 64 MiB.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import carry  # noqa: E402
import fatbin  # noqa: E402

from server.patching import wheel  # noqa: E402

ARCH = 90  # the H200
CARRY_LIMIT = 64 * 2**20
EXTENSIONS = (  # loaded on the sparse-MLA path (platform init, FlashMLA, FA3, DeepGEMM)
    "vllm/_C*.so",
    "vllm/_flashmla_C*.so",
    "vllm/_flashmla_extension_C*.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C*.so",
    "vllm/third_party/deep_gemm/_C*.so",
)
LEFT_OUT = ("vllm/vllm-rs", "*/__pycache__/*", "vllm/_moe_C*.so")


def tree(release: str, archive: Path) -> dict[str, object]:
    """Write the release's tree as a deterministic .tar.xz; what each extension kept."""
    source = wheel.fetch(release, ROOT / ".cache" / "wheels")
    modules: dict[str, object] = {}
    raw = archive.with_suffix("")  # the plain tar, compressed below with every core
    with (
        zipfile.ZipFile(source) as zipped,
        tarfile.open(raw, "w", format=tarfile.GNU_FORMAT) as tar,
    ):
        for info in sorted(zipped.infolist(), key=lambda item: item.filename):
            name = info.filename
            if info.is_dir() or any(fnmatch.fnmatch(name, pattern) for pattern in LEFT_OUT):
                continue
            data = zipped.read(info)
            if name.endswith(".so"):
                if not any(fnmatch.fnmatch(name, pattern) for pattern in EXTENSIONS):
                    continue
                data, zeroed = fatbin.prune(data, ARCH)
                kept = {f"{'cubin' if kind == fatbin.CUBIN else 'ptx'}_{arch}": size
                        for (kind, arch), size in sorted(fatbin.architectures(data).items())
                        if arch == ARCH}  # fmt: skip
                modules[name] = {"bytes": len(data), "zeroed": zeroed, "kept": kept}
                print(f"  {name}: {len(data) / 2**20:.0f} MiB, {zeroed / 2**20:.0f} MiB zeroed")
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o755 if name.endswith(".so") else 0o644
            tar.addfile(member, io.BytesIO(data))
    print(f"  compressing {raw.stat().st_size / 2**20:.0f} MiB with xz")
    subprocess.run(["xz", "-9e", "-T0", "-f", str(raw)], check=True)
    return {"wheel": source.name, "extensions": modules}


def project_wheel(dest: Path) -> Path:
    """mla-serve's own wheel, built from this checkout."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(ROOT)],
        check=True,
    )
    return next(dest.glob("mla_serve-*.whl"))


def repository_bytes() -> int:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-version", default="0.33.0")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "e2e-pack")
    args = parser.parse_args()
    out: Path = args.out
    for stale in (*out.glob("wheels/*.whl"), *out.glob("vllm*.tar*")):
        stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    print(f"vLLM {args.vllm_version}: tree and extension modules (sm_{ARCH} device code only)")
    built = tree(args.vllm_version, out / "vllm.tar.xz")
    print("wheels")
    wheels = carry.wheels(ROOT / "tests" / "e2e" / "wheels.txt", out / "wheels")
    wheels.append(project_wheel(out / "wheels"))
    print("model")
    subprocess.run([sys.executable, str(ROOT / "tests/e2e/model.py"), "--out", str(out / "model")],
                   check=True)  # fmt: skip
    pack = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    total = pack + repository_bytes()
    (out / "pack.json").write_text(
        json.dumps(
            {"vllm_version": args.vllm_version, "arch": f"sm_{ARCH}", **built,
             "wheels": sorted(w.name for w in wheels), "pack_bytes": pack, "carry_bytes": total},
            indent=2,
        ) + "\n"
    )  # fmt: skip
    print(f"pack: {out} ({pack / 2**20:.1f} MiB; with the repository {total / 2**20:.1f} MiB)")
    if total > CARRY_LIMIT:
        print(f"error: a device run carries at most {CARRY_LIMIT >> 20} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
