"""`make dist`'s artifact: the release's real vLLM wheel with the series applied, pip-installable.

The wheel is built once (module fixture) from the cached wheel of the oldest release whose
series is not empty, through `mla-serve patches wheel`; it is installed with pip into a fresh
venv, where `mla-serve patches verify` and the probes run on the installed site-packages.
pip does not compare a wheel's files with its RECORD when it installs it, so the negative
case (one byte changed, the ZIP itself kept sound) is refused by `mla-serve patches
check-wheel`, the verifier `patches wheel` also runs on what it writes.
"""

from __future__ import annotations

import base64
import binascii
import csv
import filecmp
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from mla_serve import cli
from mla_serve.patching import catalog as catalog_
from mla_serve.patching import dist, manifest, wheel
from tests import trees

CATALOG = catalog_.load()
RELEASE = next(r for r in CATALOG.releases if CATALOG.series(r).patches)
SERIES = CATALOG.series(RELEASE)
# Every probe passes on the patched tree, but where a verdict says the bug's code is there and
# never reached (0.27.1's dsv4-indexer-capture-shortcut): there it finds it unreachable.
EXPECTED_PROBES = {
    fix.id: "unreachable" if fix.on(RELEASE).verdict else "pass" for fix in CATALOG.fixes
}


@dataclass(frozen=True)
class Built:
    source: Path
    path: Path
    output: str


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("dist")
    source = wheel.fetch(RELEASE, trees.CACHE / "wheels")
    command = [sys.executable, "-m", "mla_serve.cli", "patches", "wheel"]
    command += ["--vllm-version", RELEASE, "--cache", str(trees.CACHE / "wheels")]
    command += ["--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=trees.ROOT, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("patched wheel: "), result.stdout
    path = Path(last.removeprefix("patched wheel: "))
    assert [p.name for p in out.iterdir()] == [path.name]  # no temporary file left behind
    return Built(source, path, result.stdout)


def hex_of(record_hash: str) -> str:
    assert record_hash.startswith("sha256=")
    encoded = record_hash.removeprefix("sha256=")
    return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).hex()


def record(archive: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/RECORD")]
    rows = csv.reader(io.StringIO(archive.read(name).decode()))
    return {path: (digest, size) for path, digest, size in rows}


def test_wheel_name_version_and_dist_info(built: Built) -> None:
    source = dist.WheelName.parse(built.source.name)
    name = dist.WheelName.parse(built.path.name)
    label = SERIES.digest[:12]
    assert name.version == f"{RELEASE}+mla.{label}", built.path.name
    assert (name.distribution, name.build, name.tags) == ("vllm", source.build, source.tags)
    assert built.path.name == f"vllm-{RELEASE}+mla.{label}-{source.tags}.whl"
    assert f"sha256: {hashlib.sha256(built.path.read_bytes()).hexdigest()}" in built.output
    with zipfile.ZipFile(built.source) as old, zipfile.ZipFile(built.path) as new:
        folders = {n.split("/")[0] for n in new.namelist() if ".dist-info/" in n}
        assert folders == {f"vllm-{name.version}.dist-info"}
        info = f"vllm-{name.version}.dist-info"
        metadata = new.read(f"{info}/METADATA").decode()
        assert re.search(rf"^Version: {re.escape(name.version)}$", metadata, re.MULTILINE)
        assert (
            metadata.replace(name.version, RELEASE, 1)
            == old.read(f"vllm-{RELEASE}.dist-info/METADATA").decode()
        )
        assert new.read(f"{info}/WHEEL") == old.read(f"vllm-{RELEASE}.dist-info/WHEEL")
        assert new.namelist()[-1] == f"{info}/RECORD"


def test_every_unchanged_member_is_the_source_member(built: Built) -> None:
    """Same bytes (same compressed bytes, CRC, time, mode), and the same RECORD row."""
    version = dist.WheelName.parse(built.path.name).version
    changed = {row["path"] for row in json.loads(manifest_text(built))["files"]}
    assert changed, "the series changes no file: this test would prove nothing"
    with zipfile.ZipFile(built.source) as old, zipfile.ZipFile(built.path) as new:
        old_record, new_record = record(old), record(new)
        kept = 0
        for info in old.infolist():
            if info.filename in changed or ".dist-info/" in info.filename:
                continue
            mine = new.getinfo(info.filename)
            fields = ("CRC", "compress_size", "file_size", "compress_type", "date_time")
            fields += ("external_attr",)
            assert [getattr(mine, f) for f in fields] == [getattr(info, f) for f in fields]
            assert raw(built.path, mine) == raw(built.source, info), info.filename
            assert new_record[info.filename] == old_record[info.filename]
            kept += 1
        renamed = {
            n.replace(f"vllm-{RELEASE}.dist-info", f"vllm-{version}.dist-info")
            for n in old.namelist()
        }
        assert set(new.namelist()) == renamed | {dist.MANIFEST_MEMBER}
    assert kept == len(renamed) - len(changed) - sum(".dist-info/" in n for n in renamed)


def raw(path: Path, info: zipfile.ZipInfo) -> bytes:
    """The member's stored (compressed) bytes, for the small ones; the digest of the large."""
    with path.open("rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
        handle.seek(info.header_offset + 30 + sum(struct.unpack("<2H", header[26:30])))
        size = info.compress_size
        if size > 1 << 20:  # the large .so members: compared by digest, read in blocks
            digest = hashlib.sha256()
            while size:
                block = handle.read(min(size, 1 << 20))
                digest.update(block)
                size -= len(block)
            return digest.digest()
        return handle.read(size)


def manifest_text(built: Built) -> str:
    with zipfile.ZipFile(built.path) as archive:
        return archive.read(dist.MANIFEST_MEMBER).decode()


def test_changed_files_are_the_series_result_and_record_has_their_hashes(built: Built) -> None:
    document = json.loads(manifest_text(built))
    assert document["series"]["digest"] == SERIES.digest
    assert document["vllm_version"] == RELEASE
    assert {fix["id"]: fix["probe"] for fix in document["fixes"]} == EXPECTED_PROBES
    with zipfile.ZipFile(built.source) as old, zipfile.ZipFile(built.path) as new:
        old_record, new_record = record(old), record(new)
        for row in document["files"]:
            data = new.read(row["path"])
            assert hashlib.sha256(data).hexdigest() == row["sha256_after"]
            assert hex_of(new_record[row["path"]][0]) == row["sha256_after"]
            assert new_record[row["path"]][1] == str(len(data))
            assert hex_of(old_record[row["path"]][0]) == row["sha256_before"]
        data = new.read(dist.MANIFEST_MEMBER)
        assert new_record[dist.MANIFEST_MEMBER] == (dist.record_hash(data), str(len(data)))


def test_same_inputs_give_the_same_bytes(built: Built, tmp_path: Path) -> None:
    again = dist.build(built.source, tmp_path, CATALOG)
    assert again.path.name == built.path.name
    assert filecmp.cmp(again.path, built.path, shallow=False)


def test_pip_installs_it_into_a_fresh_venv_where_verify_and_the_probes_pass(
    built: Built, tmp_path: Path
) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # the test's own pip installs into it (--python)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install"]
    install += ["--no-deps", "--no-index", "--no-compile", "--quiet", str(built.path)]
    result = subprocess.run(install, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    version = dist.WheelName.parse(built.path.name).version
    # The installed tree, found as vLLM's own import system finds it: no --target.
    env = {**os.environ, "PYTHONPATH": str(trees.ROOT)}
    env.pop("MLA_SERVE_PATCHES", None)

    def mla_serve(*args: str) -> subprocess.CompletedProcess[str]:
        command = [str(python), "-m", "mla_serve.cli", "patches", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, check=False)

    probe = "import importlib.metadata as m, importlib.util as u; "
    probe += "print(m.version('vllm')); print(u.find_spec('vllm').origin)"
    shown = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, env=env, check=False
    )
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    assert shown.stdout.split() == [version, str(site / "vllm" / "__init__.py")], shown
    assert (site / f"vllm-{version}.dist-info" / "RECORD").is_file()

    verified = mla_serve("verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"at {site} matches {site / 'vllm' / manifest.FILENAME}" in verified.stdout
    status = mla_serve("status", "--format", "json")
    assert status.returncode == 0, status.stderr
    states = json.loads(status.stdout)
    probes = {fix["id"]: fix["probe"] for fix in states["fixes"]}
    assert probes == EXPECTED_PROBES, probes
    patched = [f["id"] for f in states["fixes"] if f["status"] == "patched"]
    assert len(patched) == sum(bool(f.on(RELEASE).patches) for f in CATALOG.fixes) > 0

    # The installed files are the wheel's: one edit to a patched file is drift.
    touched = site / json.loads(manifest_text(built))["files"][0]["path"]
    text = touched.read_text()
    touched.write_text(text.replace("def ", "def  ", 1))
    drift = mla_serve("verify")
    assert drift.returncode == 1 and "DRIFT" in drift.stderr, drift.stderr


def tamper(source: Path, dest: Path, member: str) -> None:
    """A copy of `source` with one byte of the stored `member` changed and its CRC-32 (local
    header and central directory) made to match, so the ZIP is sound and only RECORD knows."""
    shutil.copyfile(source, dest)
    with zipfile.ZipFile(dest) as archive:
        info = archive.getinfo(member)
        data = bytearray(archive.read(member))
    assert info.compress_type == zipfile.ZIP_STORED  # what `patches wheel` writes
    at = data.index(b"def ")
    data[at] = ord("D")
    crc = struct.pack("<L", binascii.crc32(data))
    with dest.open("r+b") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
        handle.seek(info.header_offset + 30 + sum(struct.unpack("<2H", header[26:30])) + at)
        handle.write(b"D")
        handle.seek(info.header_offset + 14)
        handle.write(crc)
        handle.seek(-22, os.SEEK_END)
        size, start = struct.unpack("<2L", handle.read(22)[12:20])
        handle.seek(start)
        central = handle.read(size)
        position = 0
        while True:
            name_length, extra, comment = struct.unpack(
                "<3H", central[position + 28 : position + 34]
            )
            if central[position + 46 : position + 46 + name_length] == member.encode():
                handle.seek(start + position + 16)
                handle.write(crc)
                break
            position += 46 + name_length + extra + comment
    with zipfile.ZipFile(dest) as archive:
        assert archive.read(member) == bytes(data)  # sound: the CRC-32 matches


def test_check_wheel_refuses_one_changed_byte(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["patches", "check-wheel", str(built.path)]) == 0
    assert "files match RECORD" in capsys.readouterr().out
    member = json.loads(manifest_text(built))["files"][0]["path"]
    bad = tmp_path / built.path.name
    tamper(built.path, bad, member)
    assert cli.main(["patches", "check-wheel", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"BAD {member}: sha256="), err
    assert err[1] == f"{bad} does not match its RECORD"


def test_local_version() -> None:
    digest = "0123456789ab" + "c" * 52
    assert dist.local_version("0.33.0", digest) == "0.33.0+mla.0123456789ab"
    assert dist.local_version("0.33.0+cu130", digest) == "0.33.0+cu130.mla.0123456789ab"
    # PEP 440's normal form: an all-digit label segment is a number (no leading zeros).
    assert dist.local_version("0.33.0", "0012345678901" + "0" * 51) == "0.33.0+mla.1234567890"
    with pytest.raises(dist.DistError, match="already an mla-serve build"):
        dist.local_version("0.33.0+mla.0123456789ab", digest)
    with pytest.raises(dist.DistError, match="not a sha256"):
        dist.local_version("0.33.0", "xyz")


def test_wheel_names() -> None:
    name = dist.WheelName.parse("vllm-0.33.0-1-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert (name.version, name.build, name.tags) == (
        "0.33.0",
        "1",
        "cp38-abi3-manylinux_2_28_x86_64",
    )
    assert (
        name.filename("0.33.0+mla.x") == "vllm-0.33.0+mla.x-1-cp38-abi3-manylinux_2_28_x86_64.whl"
    )
    for bad in ("vllm-0.33.0.tar.gz", "vllm-0.33.0-cp38.whl", "vllm--cp38-abi3-any.whl"):
        with pytest.raises(dist.DistError, match="not a wheel file name"):
            dist.WheelName.parse(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vllm-version", "9.9.9"], "vLLM 9.9.9 is not a supported release"),
        (["--wheel", "{tmp}/vllm-0.33.0.tar.gz"], "is not a wheel file name"),
        (["--wheel", "{tmp}/torch-2.13.0-cp311-cp311-linux_x86_64.whl"], "is not a vLLM wheel"),
        (["--wheel", "{tmp}/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"], "cannot read"),
        (["--wheel", "{tmp}/vllm-0.33.0+cu130.mla.0a-cp38-abi3-linux_x86_64.whl"], "already an"),
        (["--wheel", "{tmp}/not-a-zip/vllm-0.33.0-cp38-abi3-linux_x86_64.whl"], "cannot read"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "not-a-zip").mkdir()
    (tmp_path / "not-a-zip" / "vllm-0.33.0-cp38-abi3-linux_x86_64.whl").write_text("no zip")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code = cli.main(["patches", "wheel", *args, "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert not (tmp_path / "out").exists()


def test_check_wheel_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["patches", "check-wheel", str(tmp_path / "x.tar.gz")]) == 2
    assert "is not a wheel file name" in capsys.readouterr().err
    path = tmp_path / "vllm-0.33.0-cp38-abi3-linux_x86_64.whl"
    path.write_bytes(b"PK but not a zip")
    assert cli.main(["patches", "check-wheel", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("BAD cannot read vllm-0.33.0-cp38-abi3-linux_x86_64.whl as a ZIP")
    # No file to judge is bad input, not a bad wheel: one line, exit 2.
    missing = tmp_path / "vllm-0.29.0-cp38-abi3-linux_x86_64.whl"
    folder = tmp_path / "folder" / "vllm-0.29.0-cp38-abi3-linux_x86_64.whl"
    folder.mkdir(parents=True)
    for path, reason in ((missing, "No such file or directory"), (folder, "Is a directory")):
        assert cli.main(["patches", "check-wheel", str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"mla-serve: error: cannot read {path}: {reason}\n"
        assert captured.out == ""


@pytest.mark.parametrize("source", ["--wheel", "--vllm-version"])
def test_an_unusable_out_folder_is_refused_before_the_wheel_is_read(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before fetching, unpacking and patching (about 20 s), not after: one line, exit 2."""
    cached = wheel.fetch(RELEASE, trees.CACHE / "wheels")
    given = str(cached) if source == "--wheel" else RELEASE
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "dist", Path("/proc/mla-serve-dist")):
        command = ["patches", "wheel", source, given, "--cache", str(trees.CACHE / "wheels")]
        code = cli.main([*command, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 2
        assert captured.err.startswith(f"mla-serve: error: cannot write into {out}: ")
        assert captured.err.count("\n") == 1
        assert "unpacking" not in captured.out and "series" not in captured.out
        assert not out.exists()


def test_rewrite_adds_removes_and_renames_data_and_non_ascii_members(tmp_path: Path) -> None:
    """The writer's paths the release series do not take (no series creates or deletes a
    file, vLLM's wheels have no .data folder and ASCII names only), on a small wheel."""
    files = {
        "demo/__init__.py": b"",
        "demo/gone.py": b"x = 1\n",
        "demo/caf\u00e9.txt": "caf\u00e9\n".encode(),
        "demo-1.0.data/scripts/demo": b"#!python\n",
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n"
        b"\nVersion: 1.0 (body)\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    rows = [(n, dist.record_hash(d), str(len(d))) for n, d in files.items()]
    rows.append(("demo-1.0.dist-info/RECORD", "", ""))
    source = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(source, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr("demo-1.0.dist-info/RECORD", dist._record_bytes(rows))
    name = dist.WheelName.parse(source.name)
    dest = tmp_path / name.filename("1.0+local")
    changes = {"demo/gone.py": None, "demo/new.py": b"y = 2\n", "demo/__init__.py": b"z = 3\n"}
    written = dist.rewrite(source, dest, name, "1.0+local", changes)
    assert written == hashlib.sha256(dest.read_bytes()).hexdigest()
    assert dist.check(dest) == ([], 6)  # RECORD itself has no hash
    with zipfile.ZipFile(dest) as archive:
        assert archive.testzip() is None
        assert archive.namelist() == [
            "demo/__init__.py",
            "demo/caf\u00e9.txt",
            "demo-1.0+local.data/scripts/demo",
            "demo/new.py",
            "demo-1.0+local.dist-info/METADATA",
            "demo-1.0+local.dist-info/WHEEL",
            "demo-1.0+local.dist-info/RECORD",
        ]
        assert archive.read("demo/__init__.py") == b"z = 3\n"
        assert archive.getinfo("demo/caf\u00e9.txt").flag_bits & 0x800
        metadata = archive.read("demo-1.0+local.dist-info/METADATA")
        assert metadata.endswith(b"Version: 1.0+local\n\nVersion: 1.0 (body)\n")  # body kept
    assert dist.rewrite(source, tmp_path / "again.whl", name, "1.0+local", changes) == written
