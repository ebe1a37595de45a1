"""`make e2e-pack`: its pruning of CUDA modules, its archives and carries, and their unpacking.

The H200 runs (results/e2e) show the pruned modules load and serve; this
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
        kept -= set(layout["dropped"]) | set(layouts.PARALLEL)
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


def test_each_profile_serves_its_own_family_on_one_and_two_gpus() -> None:
    """dsv4-flash serves the tiny DeepSeek-V4-Flash and gb300-tp4 the tiny GLM-5.3-Flash, with
    every flag of the chart's command line but the model's (parsers and expert parallelism
    included), on two GPUs and, as PROFILE@1, on one; the GLM-5.2 profiles keep the V3.2."""
    from tests.e2e import layouts, model

    scaled = layouts.layouts(gpus=2)
    for profile, tiny in (("dsv4-flash", model.DEEPSEEK_V4_FLASH),
                          ("gb300-tp4", model.GLM53_FLASH)):  # fmt: skip
        for name, tp in ((profile, 2), (f"{profile}@1", 1)):
            layout = scaled[name]
            assert layout["model"] == tiny.name and layout["model_dir"] == tiny.directory()
            assert layout["served_model_name"] == tiny.served_name
            assert layout["parallel"] == {"tp": tp, "pcp": 1, "dcp": 1}
            # all but the DeepSeek-V4 profile's MXFP4 indexer cache, which Hopper refuses
            hopper = {"--attention-config.indexer_kv_dtype"} if profile == "dsv4-flash" else set()
            assert set(layout["dropped"]) == hopper, layout["dropped"]
            chart = [a for a in layout["chart_argv"][1:] if a.split("=")[0] not in (
                *layouts.REPLACED, *layouts.PARALLEL, *hopper)]  # fmt: skip
            assert set(chart) <= set(layout["argv"]), set(chart) - set(layout["argv"])
            flags = dict(layouts.split(layout["argv"]))
            assert flags["--reasoning-parser"] == tiny.reasoning_parser
            assert flags["--tool-call-parser"] == tiny.tool_parser
    assert "--enable-expert-parallel" in scaled["dsv4-flash@1"]["argv"]  # DSv4 has experts
    for name in ("tp1", "b200-tp2-pcp2", "b200-tp1-pcp4@1"):
        assert scaled[name]["model"] == model.DEEPSEEK_V32.name
        assert "--reasoning-parser=deepseek_v3" in scaled[name]["argv"]
    glm52 = scaled["b200-tp2-pcp2"]
    assert "--tool-call-parser" in glm52["dropped"] and "--enable-expert-parallel" in glm52[
        "dropped"]  # fmt: skip
    # A layout of the tiny GLM-5.2 (its own family) keeps the profile's parsers.
    own = layouts.scale("b200-tp2-pcp2", glm52["chart_argv"], 1, model.GLM52)
    assert "--tool-call-parser=glm47" in own["argv"] and not own["dropped"]
    assert own["argv"].count("--reasoning-parser=glm45") == 1


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


def test_the_moe_and_kda_modules_travel_apart_and_are_laid_over_each_stacks_tree(
    module: bytes, tmp_path: Path
) -> None:
    """The release's carry leaves out the MoE and KDA modules, which go to ext-<release>;
    a stack's tree gets both (matrix.prepare), and a store without the extension carry is
    refused before anything starts."""
    import fnmatch
    import json

    from tests.e2e import matrix, pack

    with zipfile.ZipFile(wheel.fetch("0.33.0", ROOT / ".cache" / "wheels")) as zipped:
        modules = [n for n in zipped.namelist() if n.endswith(".so")]
    main = {n for n in modules if any(fnmatch.fnmatch(n, p) for p in pack.EXTENSIONS)}
    extra = {n for n in modules if any(fnmatch.fnmatch(n, p) for p in pack.EXTRA_EXTENSIONS)}
    assert extra == {"vllm/_moe_C_stable_libtorch.abi3.so", "vllm/_flashkda_C.abi3.so"}
    assert not main & extra and MODULE in main

    store, release = tmp_path / "store", "0.33.0"
    tree = store / f"vllm-{release}" / "tree" / "vllm"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("")
    (tree.parent.parent / "pack.json").write_text(
        json.dumps({"extension_carry": {"name": f"ext-{release}"}})
    )
    assert matrix.missing_carries(store, release) == [f"ext-{release}"]
    laid = store / f"ext-{release}" / "tree" / "vllm"
    laid.mkdir(parents=True)
    (laid / "_moe_C_stable_libtorch.abi3.so").write_bytes(module)
    assert matrix.missing_carries(store, release) == []
    stack_tree, _ = matrix.prepare(store, tmp_path / "work", release, "pristine")
    assert (stack_tree / "vllm" / "__init__.py").is_file()
    assert (stack_tree / "vllm" / "_moe_C_stable_libtorch.abi3.so").read_bytes() == module


def test_the_extension_carry_holds_the_modules_alone_pruned(module: bytes, tmp_path: Path) -> None:
    """`tree(..., python=False)` on vLLM 0.33.0's wheel: an archive of the named modules
    only (no Python file, no other module), each pruned to sm_90, in the pack's format."""
    from tests.e2e import archive
    from tests.e2e import pack as e2e_pack

    source = wheel.fetch("0.33.0", ROOT / ".cache" / "wheels")
    dest = tmp_path / "ext-0.33.0" / "ext.tar.xz"
    dest.parent.mkdir()
    with archive.Packer(tmp_path / "cache", jobs=1) as packer:
        built = e2e_pack.tree(source, packer, dest, (MODULE,), python=False)
        packer.finish()
    assert list(built["extensions"]) == [MODULE]
    assert archive.extract(dest, tmp_path / "tree") == 0
    assert read_tree(tmp_path / "tree") == {MODULE: fatbin.prune(module, 90)[0]}


def made_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zipped:
        for name, data in members.items():
            zipped.writestr(name, data)
    return path


def test_wheel_files_leave_out_only_what_pip_puts_outside_site_packages(tmp_path: Path) -> None:
    """A wheel's `<dist>.data/` (z3's 22 MB command-line binary) stays home; a package's own
    folder that happens to be named `*.data` travels."""
    from tests.e2e import pack as e2e_pack

    made = made_wheel(tmp_path / "z3_solver-1.0-py3-none-any.whl", {
        "z3/__init__.py": b"",
        "z3/lib/libz3.so": ELF_HEADER,
        "z3/tables.data/index.json": b"{}",
        "z3_solver-1.0.data/data/bin/z3": ELF_HEADER,
        "z3_solver-1.0.dist-info/METADATA": b"Name: z3-solver\n",
    })  # fmt: skip
    assert [name for name, _ in e2e_pack.wheel_files([made])] == [
        "z3/__init__.py",
        "z3/lib/libz3.so",
        "z3/tables.data/index.json",
        "z3_solver-1.0.dist-info/METADATA",
    ]


def test_releases_on_one_dsl_version_share_its_deps_carry_or_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One deps-<version> carry per CuTe DSL version, with TileLang and z3 where a release
    on it pins TileLang; two releases pinning different TileLangs on one DSL version are
    refused before anything is written (one site directory per DSL version)."""
    from tests import carry
    from tests.e2e import pack as e2e_pack

    monkeypatch.setattr(carry, "CACHE", tmp_path)
    monkeypatch.setattr(carry, "_pip_download", lambda *pins: pytest.fail(f"asked for {pins}"))
    for name in ("nvidia_cutlass_dsl_libs_cu13-4.8.0-cp312-cp312-manylinux_2_28_x86_64",
                 "nvidia_cutlass_dsl_libs_cu13-4.6.2-cp312-cp312-manylinux_2_28_x86_64",
                 "tilelang-0.1.12-cp38-abi3-manylinux_2_28_x86_64",
                 "tilelang-0.1.13-cp38-abi3-manylinux_2_28_x86_64",
                 "z3_solver-4.15.4.0-py3-none-manylinux2014_x86_64"):  # fmt: skip
        (tmp_path / f"{name}.whl").write_bytes(b"wheel")
    carries = e2e_pack.deps_carries({
        "0.33.0": {"nvidia-cutlass-dsl": "4.8.0", "tilelang": "0.1.12"},
        "0.32.0": {"nvidia-cutlass-dsl": "4.8.0"},
        "0.29.0": {"nvidia-cutlass-dsl": "4.6.2"},
        "0.20.0": {},
    })  # fmt: skip
    assert {dsl: [w.name.split("-")[:2] for w in found] for dsl, found in carries.items()} == {
        "4.8.0": [["nvidia_cutlass_dsl_libs_cu13", "4.8.0"], ["tilelang", "0.1.12"],
                  ["z3_solver", "4.15.4.0"]],
        "4.6.2": [["nvidia_cutlass_dsl_libs_cu13", "4.6.2"]],
    }  # fmt: skip
    with pytest.raises(SystemExit, match=r"deps-4.8.0 would hold both tilelang-0.1.12-.* and "
                       r"tilelang-0.1.13-.* \(vLLM 0.34.0 pins the latter\)"):  # fmt: skip
        e2e_pack.deps_carries({
            "0.33.0": {"nvidia-cutlass-dsl": "4.8.0", "tilelang": "0.1.12"},
            "0.34.0": {"nvidia-cutlass-dsl": "4.8.0", "tilelang": "0.1.13"},
        })  # fmt: skip


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
    """A release's carry, its extension carry and the compiled packages in three parts, as
    `make e2e-pack` lays them out, through `run.sh unpack` as the GPU machine runs it (its
    Python alone, the carries in any order); a stack's tree then holds both trees."""
    from tests.e2e import archive, matrix, parts

    out, store, cache = tmp_path / "e2e", tmp_path / "store", tmp_path / "cache"
    tree, site = files(1), {"quack/__init__.py": b"x = 1\n", "cutlass/__init__.py": b""}
    rng = random.Random(2)
    extension = {"pkg/_moe_C.abi3.so": ELF_HEADER + rng.randbytes(5000)}
    libs = {
        "nvidia_cutlass_dsl/lib/libcute_dsl_runtime.so": ELF_HEADER + rng.randbytes(9000),
        "tilelang/lib/libtilelang.so": ELF_HEADER + rng.randbytes(3000),
        "tilelang/__init__.py": b"import z3\n",
        "z3/lib/libz3.so": ELF_HEADER + rng.randbytes(3000),
    }
    flashinfer = {
        "flashinfer/__init__.py": b"",
        "flashinfer/data/csrc/batch_mla.cu": rng.randbytes(2000),
        "flashinfer_python-9.0.dist-info/METADATA": b"Name: flashinfer-python\n",
    }
    release, extra = out / "vllm-9.9.9", out / "ext-9.9.9"
    pack(cache, tree, release / "vllm.tar.xz")
    pack(cache, site, release / "site.tar.xz")
    pack(cache, extension, extra / "ext.tar.xz")
    pack(cache, flashinfer, out / "flashinfer-9.0" / "flashinfer.tar.xz", archive.FAST)
    (release / "pack.json").write_text(
        json.dumps({"cute_dsl_version": "1.0", "extension_carry": {"name": extra.name},
                    "flashinfer_carry": {"name": "flashinfer-9.0"}})
    )  # fmt: skip
    whole = tmp_path / "libs" / "cute-dsl-libs.tar.xz"
    pack(cache, libs, whole, archive.FAST)
    folders = parts.split(whole, out, "deps-1.0", whole.stat().st_size // 3 + 1)
    assert len(folders) == 3

    done = run_sh(store, folders[0], release)
    assert done.returncode == 0, done.stderr
    assert read_tree(store / "vllm-9.9.9" / "tree") == tree
    assert read_tree(store / "deps-1.0" / "site") == site  # the libraries wait for their parts
    assert matrix.missing_carries(store, "9.9.9") == ["ext-9.9.9", "flashinfer-9.0"]
    done = run_sh(store, folders[1], extra, folders[2], out / "flashinfer-9.0")
    assert done.returncode == 0, done.stderr
    assert read_tree(store / "ext-9.9.9" / "tree") == extension
    assert read_tree(store / "deps-1.0" / "site") == site | libs
    assert read_tree(store / "flashinfer-9.0" / "site") == flashinfer
    assert not (store / "deps-1.0" / "cute-dsl-libs.tar.xz").exists()
    assert matrix.missing_carries(store, "9.9.9") == []
    assert str(store / "flashinfer-9.0" / "site") in matrix.site_paths(store, "9.9.9")
    stack_tree, _ = matrix.prepare(store, tmp_path / "work", "9.9.9", "pristine")
    assert read_tree(stack_tree) == tree | extension

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


def test_flashinfer_travels_at_the_images_pin() -> None:
    """The FlashInfer carry's version is the one the image installs with the release (its
    hash lock), for every release the catalog supports; no lock, no pin."""
    from mla_serve.patching import catalog
    from tests.e2e import pack as e2e_pack

    for release in catalog.load().releases:
        lock = (ROOT / "docker" / "locks" / f"vllm-{release}.txt").read_text()
        pinned = e2e_pack.image_pin(release, e2e_pack.FLASHINFER)
        assert pinned is not None and f"\nflashinfer-python=={pinned} " in lock
    assert e2e_pack.image_pin("0.33.0", e2e_pack.FLASHINFER) == "0.7.2.post1"
    assert e2e_pack.image_pin("9.9.9", e2e_pack.FLASHINFER) is None
