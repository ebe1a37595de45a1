"""`make e2e-pack`: its pruning of CUDA modules, its archives and carries, and their unpacking.

The H200 run (tests/e2e/results) shows the pruned modules load and serve; this
checks, on CPU, that pruning keeps every byte an sm_90 GPU loads and every byte
outside the dropped payloads, and zeroes the payloads of other architectures (on a
real module from vLLM 0.33.0's wheel). And that what the pack writes (segmented,
cached .tar.xz archives, parts) unpacks as `run.sh unpack` does on the GPU machine.
"""

from __future__ import annotations

import json
import lzma
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from mla_serve.patching import wheel
from tests.e2e import fatbin

ROOT = Path(__file__).resolve().parents[1]

MODULE = "vllm/_flashmla_extension_C.abi3.so"  # small, with sm_90 and sm_100 cubins


@pytest.fixture(scope="module")
def module() -> bytes:
    source = wheel.fetch("0.33.0", ROOT / ".cache" / "wheels")
    with zipfile.ZipFile(source) as zipped:
        return zipped.read(MODULE)


def entries(data: bytes) -> list[fatbin.Entry]:
    return [entry for group in fatbin.fatbins(data) for entry in group]


def test_pruning_keeps_sm90_code_and_zeroes_the_rest(module: bytes) -> None:
    pruned, zeroed = fatbin.prune(module, 90)
    assert len(pruned) == len(module)
    before = entries(module)
    assert {e.arch for e in before if e.kind == fatbin.CUBIN} >= {90, 100}
    assert entries(pruned) == before  # every header intact: the driver still parses them
    for entry in before:
        payload = slice(entry.offset, entry.offset + entry.size)
        if entry.kind == fatbin.CUBIN and entry.arch == 90:
            assert pruned[payload] == module[payload]
        else:
            assert pruned[payload] == bytes(entry.size)
    assert zeroed == sum(e.size for e in before if not (e.kind == fatbin.CUBIN and e.arch == 90))
    changed = [i for i, (a, b) in enumerate(zip(module, pruned, strict=True)) if a != b]
    inside = {i for e in before for i in range(e.offset, e.offset + e.size)}
    # Nothing outside the dropped payloads moved: code, symbols and section table as shipped.
    assert set(changed) <= inside


def test_a_file_that_is_not_elf_is_refused() -> None:
    with pytest.raises(fatbin.FatbinError):
        fatbin.prune(b"not an ELF file" * 8, 90)


def test_profiles_scale_to_two_hopper_gpus() -> None:
    """Every Helm profile's rendered command line, scaled for `make e2e` on two H200s."""
    from tests.e2e import layouts

    scaled = layouts.layouts(gpus=2)
    assert set(scaled) >= {"tp1", "gb300-tp4", "b200-tp2-pcp2", "b200-tp1-pcp4-dcp4"}
    for name, layout in scaled.items():
        tp, pcp, dcp = (layout["parallel"][axis] for axis in ("tp", "pcp", "dcp"))
        assert tp * pcp == layout["gpus"] <= 2, name
        assert tp % dcp == 0, name  # vLLM: DCP divides TP (PCP is gone under DCP)
        flags = dict(layouts.split(layout["argv"]))
        assert flags["--tensor-parallel-size"] == str(tp)
        assert "--served-model-name" not in flags and "--host" not in flags
        kept = {f for f, _ in layouts.split(layout["chart_argv"][1:])} - set(layouts.REPLACED)
        kept -= set(layouts.DROPPED) | set(layouts.PARALLEL)
        assert kept <= set(flags), (name, kept - set(flags))  # every other chart flag survives
    assert scaled["b200-tp2-pcp2"]["parallel"] == {"tp": 2, "pcp": 1, "dcp": 1}
    assert scaled["b200-tp1-pcp4-dcp4"]["parallel"] == {"tp": 2, "pcp": 1, "dcp": 2}
    assert scaled["b200-tp1-pcp4-dcp4"]["heads"] == 32
    assert "--kv-cache-dtype=fp8_ds_mla" in scaled["b200-tp1-pcp4-dcp4"]["argv"]
    assert scaled["gb300-tp4"]["parallel"]["tp"] == 2
    wide = layouts.layouts(gpus=4)  # the width-four run keeps the chart's parallel flags
    assert wide["gb300-tp4"]["parallel"] == {"tp": 4, "pcp": 1, "dcp": 1}
    assert wide["b200-tp1-pcp4-dcp4"]["parallel"] == {"tp": 1, "pcp": 4, "dcp": 4}
    assert wide["b200-tp1-pcp4-dcp4"]["changes"][0].startswith("--served-model-name")


def test_a_blackwell_only_backend_is_dropped_with_the_reason() -> None:
    from tests.e2e import layouts

    scaled = layouts.scale("x", ["m", "--tensor-parallel-size=1",
                                 "--attention-backend=FLASHINFER_MLA_SPARSE"], 1)  # fmt: skip
    assert "--attention-backend=FLASHINFER_MLA_SPARSE" in scaled["dropped"]
    assert not any(arg.startswith("--attention-backend") for arg in scaled["argv"])


def test_an_archive_travels_in_parts_and_is_joined_only_whole(tmp_path: Path) -> None:
    from tests.e2e import parts

    archive = tmp_path / "libs.tar.xz"
    archive.write_bytes(bytes(range(256)) * 10)  # 2560 bytes: three parts of at most 1000
    folders = parts.split(archive, tmp_path / "out", "deps-1.0", 1000)
    assert [f.name for f in folders] == ["deps-1.0-part1", "deps-1.0-part2", "deps-1.0-part3"]
    sizes = [(f / f"libs.tar.xz.{i}").stat().st_size for i, f in enumerate(folders, 1)]
    assert sizes == [854, 854, 852]  # as even as may be: no carry fuller than it must be
    store, joined = tmp_path / "store", tmp_path / "joined.tar.xz"
    store.mkdir()
    for folder in folders[:2]:
        for item in folder.iterdir():
            (store / item.name).write_bytes(item.read_bytes())
    assert parts.join(store, joined) == 3 and not joined.exists()  # one part still missing
    third = folders[2] / "libs.tar.xz.3"
    (store / third.name).write_bytes(third.read_bytes()[:-1] + b"x")
    assert parts.join(store, joined) == 2 and not joined.exists()  # damaged: refused
    (store / third.name).write_bytes(third.read_bytes())
    assert parts.join(store, joined) == 0
    assert joined.read_bytes() == archive.read_bytes()


# The carries' archives (tests/e2e/archive.py), on small files made here: the real ones
# hold 1.2 GB of tar, which only `make e2e-pack` compresses.
ELF_HEADER = b"\x7fELF\x02\x01\x01" + bytes(11) + b"\x3e\x00"  # x86-64


def files(seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    code = bytes(rng.choice(b"\xe8\xe9\x48\x89\x00\x01\x0f") for _ in range(6000))
    return {
        "pkg/_C.abi3.so": ELF_HEADER + code * 3,  # the x86 branch filter's way
        "pkg/_small.so": ELF_HEADER + code[:500],
        "pkg/module.py": b"print('hello')\n" * 300,
        "vendored/module.py": b"print('hello')\n" * 300,  # sorted beside its copy
        "pkg/" + "deep/" * 30 + "name.txt": b"a path over 100 bytes: a GNU long-name header\n",
        "pkg/empty.json": b"",
        "pkg/notes.txt": rng.randbytes(3000),
    }


def read_tree(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def pack(cache: Path, wanted: dict[str, bytes], dest: Path, codec: Any = None) -> dict[str, int]:
    from tests.e2e import archive

    dest.parent.mkdir(parents=True, exist_ok=True)
    with archive.Packer(cache, jobs=2) as packer:
        packer.write(wanted.items(), dest, codec or archive.DENSE)
        packer.finish()
        return packer.stats


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.e2e import archive

    monkeypatch.setattr(archive, "SEGMENT_BYTES", 4096)


@pytest.mark.usefixtures("small_segments")
@pytest.mark.parametrize("codec", ["DENSE", "FAST"])
def test_an_archive_of_segments_unpacks_with_python_and_with_tar(
    tmp_path: Path, codec: str
) -> None:
    from tests.e2e import archive

    wanted = files()
    out = tmp_path / "out" / "tree.tar.xz"
    stats = pack(tmp_path / "cache", wanted, out, getattr(archive, codec))
    assert stats["segments"] == stats["compressed"] >= 4  # several xz streams, concatenated
    assert out.read_bytes().count(b"\xfd7zXZ\x00") == stats["segments"] + 1  # + the tar's end
    assert archive.extract(out, tmp_path / "python") == 0
    assert read_tree(tmp_path / "python") == wanted
    assert (tmp_path / "python" / "pkg" / "_C.abi3.so").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "python" / "pkg" / "module.py").stat().st_mode & 0o777 == 0o644
    if shutil.which("tar") and shutil.which("xz"):  # what any machine's tools read, too
        (tmp_path / "tar").mkdir()
        subprocess.run(["tar", "-xJf", str(out), "-C", str(tmp_path / "tar")], check=True)
        assert read_tree(tmp_path / "tar") == wanted


@pytest.mark.usefixtures("small_segments")
def test_a_second_pack_compresses_nothing_and_a_change_only_its_segment(tmp_path: Path) -> None:
    wanted, cache = files(), tmp_path / "cache"
    first = pack(cache, wanted, tmp_path / "first.tar.xz")
    again = pack(cache, wanted, tmp_path / "again.tar.xz")
    assert again["compressed"] == 0 and again["cached"] == first["segments"]
    assert (tmp_path / "again.tar.xz").read_bytes() == (tmp_path / "first.tar.xz").read_bytes()
    changed = wanted | {"pkg/module.py": b"print('changed')\n"}
    third = pack(cache, changed, tmp_path / "changed.tar.xz")
    assert third["compressed"] == 1 and third["cached"] == third["segments"] - 1
    assert third["compressed_bytes"] < third["bytes"] / 2
    from tests.e2e import archive

    assert archive.extract(tmp_path / "changed.tar.xz", tmp_path / "x") == 0
    assert read_tree(tmp_path / "x") == changed
    assert len(list(cache.iterdir())) == first["segments"] + 1  # no partial file left


def test_a_segment_that_fails_to_compress_fails_the_pack_plainly(tmp_path: Path) -> None:
    from tests.e2e import archive

    broken = [{"id": lzma.FILTER_LZMA2, "preset": 99}]  # no such preset: the worker raises
    with pytest.raises(SystemExit, match="error: compressing a segment failed"):
        pack(tmp_path / "cache", files(), tmp_path / "a.tar.xz", archive.Codec(broken, broken))
    assert not (tmp_path / "a.tar.xz").exists()


def test_cached_segments_nobody_used_for_a_month_go(tmp_path: Path) -> None:
    from tests.e2e import archive

    pack(tmp_path / "cache", files(), tmp_path / "a.tar.xz")
    entries = sorted((tmp_path / "cache").iterdir())
    old = time.time() - (archive.KEEP_DAYS + 1) * 86400
    os.utime(entries[0], (old, old))
    archive.prune(tmp_path / "cache")
    assert sorted((tmp_path / "cache").iterdir()) == entries[1:]


def run_sh(store: Path, *args: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"MLA_SERVE_E2E_STORE": str(store), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "tests" / "e2e" / "run.sh"), "unpack", *map(str, args)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.usefixtures("small_segments")
def test_run_sh_unpacks_what_the_pack_writes(tmp_path: Path) -> None:
    """A release's carry and the DSL's libraries in three parts, as `make e2e-pack` lays
    them out, through `run.sh unpack` as the GPU machine runs it (its Python alone)."""
    from tests.e2e import archive, parts

    out, store, cache = tmp_path / "e2e", tmp_path / "store", tmp_path / "cache"
    tree, site = files(1), {"quack/__init__.py": b"x = 1\n", "cutlass/__init__.py": b""}
    libs = {
        "nvidia_cutlass_dsl/lib/libcute_dsl_runtime.so": ELF_HEADER
        + random.Random(2).randbytes(9000)
    }
    release = out / "vllm-9.9.9"
    pack(cache, tree, release / "vllm.tar.xz")
    pack(cache, site, release / "site.tar.xz")
    (release / "pack.json").write_text(json.dumps({"cute_dsl_version": "1.0"}))
    whole = tmp_path / "libs" / "cute-dsl-libs.tar.xz"
    pack(cache, libs, whole, archive.FAST)
    folders = parts.split(whole, out, "deps-1.0", whole.stat().st_size // 3 + 1)
    assert len(folders) == 3

    done = run_sh(store, folders[0], release)
    assert done.returncode == 0, done.stderr
    assert read_tree(store / "vllm-9.9.9" / "tree") == tree
    assert read_tree(store / "deps-1.0" / "site") == site  # the libraries wait for their parts
    done = run_sh(store, folders[1], folders[2])
    assert done.returncode == 0, done.stderr
    assert read_tree(store / "deps-1.0" / "site") == site | libs
    assert not (store / "deps-1.0" / "cute-dsl-libs.tar.xz").exists()

    cut = release / "vllm.tar.xz"
    cut.write_bytes(cut.read_bytes()[:-100])  # damaged on the way: refused, said plainly
    done = run_sh(store, release)
    assert done.returncode == 2
    assert "vllm.tar.xz cannot be unpacked" in done.stderr and "Traceback" not in done.stderr


def test_the_pack_refuses_a_carry_over_its_room(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.e2e import pack as e2e_pack

    repository = 13 << 20
    room = e2e_pack.room(repository)
    assert room == 64 * 2**20 - repository
    assert (
        e2e_pack.check({"vllm-0.33.0": room - e2e_pack.HEADROOM, "common": 1 << 20}, 13 << 20) == []
    )
    printed = capsys.readouterr()
    assert "carry vllm-0.33.0: 43.0 MiB + the repository's 13.0 MiB = 56.0 of 64 MiB" in printed.out
    assert printed.err == ""
    assert e2e_pack.check({"vllm-0.33.0": room}, repository) == []  # travels, but warned
    assert "warning: carry vllm-0.33.0 leaves 0.0 MiB free" in capsys.readouterr().err
    errors = e2e_pack.check({"vllm-0.33.0": room + (1 << 20)}, repository)
    assert errors == [
        "error: carry vllm-0.33.0 is 1.0 MiB over its room of 51.0 MiB: a device run carries"
        " at most 64 MiB, the repository's 13.0 MiB with it"
    ]


def test_wheels_already_cached_are_taken_without_asking_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second pack asks pip nothing when every pinned wheel is cached (tests/carry.py)."""
    from tests import carry

    asked: list[tuple[str, ...]] = []

    def pip_download(*requirements: str) -> None:
        asked.append(requirements)
        (tmp_path / "cache" / "einops-0.8.2-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(carry, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(carry, "_pip_download", pip_download)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "loguru-0.7.3-py3-none-any.whl").write_bytes(b"wheel")
    (tmp_path / "cache" / "loguru-0.7.2-py3-none-any.whl").write_bytes(b"an older pin")
    requirements = tmp_path / "wheels.txt"
    requirements.write_text("loguru==0.7.3  # a comment\n")
    assert [w.name for w in carry.wheels(requirements, tmp_path / "out")] == [
        "loguru-0.7.3-py3-none-any.whl"
    ]
    assert [w.name for w in carry.download("loguru==0.7.3")] == ["loguru-0.7.3-py3-none-any.whl"]
    assert asked == []
    found = carry.download("loguru==0.7.3", "einops==0.8.2")  # one missing: pip fetches it
    assert [w.name for w in found] == [
        "einops-0.8.2-py3-none-any.whl",
        "loguru-0.7.3-py3-none-any.whl",
    ]
    assert asked == [("loguru==0.7.3", "einops==0.8.2")]
