"""`make e2e-pack`'s pruning of CUDA modules, on a real module from vLLM 0.33.0's wheel.

The H200 run (tests/e2e/results) shows the pruned modules load and serve; this
checks, on CPU, that pruning keeps every byte an sm_90 GPU loads and every byte
outside the dropped payloads, and zeroes the payloads of other architectures.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

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
            assert not layout["dropped"], layout["dropped"]
            chart = [a for a in layout["chart_argv"][1:] if a.split("=")[0] not in (
                *layouts.REPLACED, *layouts.PARALLEL)]  # fmt: skip
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


def test_an_archive_travels_in_parts_and_is_joined_only_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.e2e import parts

    monkeypatch.setattr(parts, "PART_BYTES", 1000)
    archive = tmp_path / "libs.tar.xz"
    archive.write_bytes(bytes(range(256)) * 10)  # 2560 bytes: three parts
    folders = parts.split(archive, tmp_path / "out", "deps-1.0")
    assert [f.name for f in folders] == ["deps-1.0-part1", "deps-1.0-part2", "deps-1.0-part3"]
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
