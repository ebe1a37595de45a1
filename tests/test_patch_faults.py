"""Hostile input and faults against the patch engine, on the real released vLLM trees.

Every case runs the real `mla-serve patches` code (through `cli.main`, in this process or in
forked children that are killed for real) on trees unpacked from the released wheels:

- a SIGKILL loop over `apply` on 0.27.1 (nine patched files; 0003 spans two): seeded
  random kill moments, every interrupted tree repaired byte for byte by the next `apply` or
  `repair`; a SIGTERM loop, where the run must roll itself back;
- SIGTERM/SIGINT in the middle of the write, a write error without a file name, a manifest
  that cannot be written, a file limit hit while journaling, an immutable file (chattr +i)
  mid-series, and a real full disk (a private tmpfs filled to leave N bytes free, N swept
  over the whole run: each apply completes, or fails naming the file with the tree restored);
- concurrent applies on one tree (lock) and on several trees sharing one manifest path;
- patch and manifest paths leaving the tree (`../`, absolute, symbolic links);
- a manifest that lists no fixes or files, or another release's statuses; a damaged journal;
- a target file that is not UTF-8, a probe that raises, a manifest of the wrong shape.

Each case that held is recorded; build/patch-faults/report.json lists them all (and
build/patch-faults/sigkill.json, sigterm.json and full-disk.json the loops' counts). Bounded:
60 SIGKILLs, 20 SIGTERMs, 45 full-disk runs, each child waited for at most 30 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mla_serve import cli
from mla_serve.patching import catalog as catalog_
from mla_serve.patching import engine, journal, manifest, tree
from tests import trees
from tests.cli_run import run

ROOT = Path(__file__).resolve().parent.parent
REPORT_DIR = ROOT / "build" / "patch-faults"
CATALOG = catalog_.load()
RELEASE = "0.27.1"  # the most patched files; 0003-dcp-rank-device-tensor spans two files
KILLS = 60
TERMS = 20
SEED = 20261130
CHILD_TIMEOUT_S = 30.0

CASES = {
    "sigkill-loop": "SIGKILL at random moments of apply: every tree repaired byte for byte",
    "sigterm-loop": "SIGTERM at random moments of apply: the run rolls itself back or completes",
    "sigterm-mid-write": "SIGTERM between two file replacements: tree restored, exit 2",
    "sigint-mid-write": "SIGINT (Ctrl-C) between two file replacements: tree restored, exit 2",
    "write-error-no-filename": "ENOSPC from write(2): the message names the file, tree restored",
    "journal-too-big": "a file-size limit while journaling: one line naming the journal",
    "manifest-is-a-directory": "manifest cannot be written: tree rolled back, one line, exit 2",
    "manifest-dir-missing": "manifest directory missing: tree rolled back, one line, exit 2",
    "concurrent-applies-one-tree": "8 applies at once on one tree: one wins, others refused",
    "lock-held": "apply while another run holds the lock: one line, exit 2",
    "shared-manifest-path": "4 trees applied at once with one --manifest path: no temp clash",
    "series-dotdot": "a patch naming ../ is refused before anything is written",
    "series-absolute": "a patch naming an absolute path is refused",
    "series-symlink-file": "a patched file that is a link out of the tree is refused",
    "series-symlink-dir": "a directory link out of the tree is refused",
    "manifest-dotdot": "verify refuses a manifest naming ../ (one line, exit 2)",
    "manifest-symlink": "verify refuses a manifest file that links out of the tree",
    "empty-manifest": "a manifest with no fixes and no files fails verify on a pristine tree",
    "entrypoint-refuses-forged": "the image entrypoint does not start vLLM on a forged manifest",
    "manifest-wrong-statuses": "a manifest claiming upstream statuses fails verify",
    "manifest-from-other-tree": "a patched tree's manifest fails verify on a pristine tree",
    "journal-detected-by-verify": "verify and status report an interrupted apply",
    "journal-damaged": "a damaged journal: one line, exit 2, nothing touched",
    "journal-outside-manifest": "a journal naming an outside file is not followed blindly",
    "non-utf8-target": "a target file that is not UTF-8: one line, exit 2 (apply/status/verify)",
    "probe-raises": "a probe that raises on drifted code fails closed, no traceback",
    "manifest-wrong-shape": "a manifest with fixes of the wrong type: one line, exit 2",
    "immutable-file": "an immutable target file (chattr +i) mid-series: tree restored",
    "full-disk-sweep": "a real full disk (tmpfs) at every point of apply: restored or complete",
    "tampered-version": "a manifest for another vLLM version fails verify",
    "tampered-digest": "a manifest with another series digest fails verify",
    "tampered-schema": "a manifest of another schema: one line, exit 2",
    "repair-cannot-write": "repair that cannot restore a file: one line, journal kept, retried",
}
HELD: dict[str, bool] = {}


def held(case: str) -> None:
    assert case in CASES
    HELD[case] = True


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    rows = [{"case": c, "what": w, "held": HELD.get(c, False)} for c, w in CASES.items()]
    document = {"tried": len(rows), "held": sum(r["held"] for r in rows), "cases": rows}
    (REPORT_DIR / "report.json").write_text(json.dumps(document, indent=2) + "\n")


# ---- helpers ------------------------------------------------------------------------------


def one_line_error(code: int, err: str) -> str:
    """Exit 2 with exactly one `mla-serve: error:` line and no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mla-serve: error: "), err
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    """Every file of the tree (bytecode caches aside), by hash: byte-exact comparisons."""
    return {
        str(p.relative_to(root)): digest(p)
        for p in sorted(root.rglob("*"))
        if (p.is_file() or p.is_symlink()) and "__pycache__" not in p.parts
    }


def series_files(release: str) -> list[str]:
    found = tree.locate(trees.pristine(release))
    return sorted(engine.plan(found, CATALOG).result)


def watched(root: Path, files: list[str]) -> dict[str, str]:
    """Every name in the directories a run writes to (journal, temporaries, manifest), with
    the hash of each file the run may change; the other files there are only listed."""
    directories = {root / "vllm"} | {(root / f).parent for f in files}
    hashed = {*files, f"vllm/{manifest.FILENAME}", f"vllm/{journal.JOURNAL}"}
    rows = {}
    for directory in sorted(directories):
        for path in directory.iterdir():
            name = str(path.relative_to(root))
            if path.is_file():
                rows[name] = digest(path) if name in hashed else "listed"
    return rows


@contextlib.contextmanager
def catalog_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, release: str) -> Iterator[Path]:
    """A private copy of the catalog (MLA_SERVE_PATCHES) whose series the test may edit."""
    root = tmp_path / "patches"
    shutil.copytree(CATALOG.root, root)
    monkeypatch.setenv("MLA_SERVE_PATCHES", str(root))
    yield root / f"vllm-{release}"


def fork_cli(argv: list[str], log: Path) -> int:
    """Run `mla-serve ARGV` in a forked child (modules already imported); returns its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(descriptor, 1)
            os.dup2(descriptor, 2)
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not pytest's capture
            for signum in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            code = cli.main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    return pid


def wait(pid: int, timeout: float = CHILD_TIMEOUT_S) -> int:
    """The child's exit status (negative: killed by that signal); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child {pid} still running after {timeout} s")
        time.sleep(0.0005)


# ---- the SIGKILL and SIGTERM loops --------------------------------------------------------


class Loop:
    """One 0.27.1 tree, killed over and over while `apply` runs, and its references."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.files = series_files(RELEASE)
        self.target = trees.clone(RELEASE, base / "tree")
        reference = trees.clone(RELEASE, base / "reference")
        self.pristine = watched(self.target, self.files)
        self.pristine_bytes = {f: (self.target / f).read_bytes() for f in self.files}
        assert cli.main(["patches", "apply", "--target", str(reference)]) == 0
        self.patched = watched(reference, self.files)
        self.full_pristine = snapshot(self.target)
        self.full_patched = snapshot(reference)
        self.journal = self.target / "vllm" / journal.JOURNAL
        self.log = base / "children.log"

    def leftovers(self) -> int:
        return sum(journal.TEMP_MARK in name for name in watched(self.target, self.files))

    def state(self) -> str:
        now = {
            k: v for k, v in watched(self.target, self.files).items() if journal.TEMP_MARK not in k
        }
        if self.journal.exists():
            return "journaled"
        if now == self.pristine:
            return "pristine"
        if now == self.patched:
            return "patched"
        return "torn"

    def reset(self) -> None:
        """Back to pristine between kills (new inodes: the shared cache is hard-linked)."""
        for name, data in self.pristine_bytes.items():
            (self.target / name).unlink()  # a new inode: never write into the shared cache
            (self.target / name).write_bytes(data)
        (self.target / "vllm" / manifest.FILENAME).unlink(missing_ok=True)
        assert self.state() == "pristine"

    def calibrate(self) -> tuple[float, float]:
        """How long the journal lives (the write phase), and the whole run's length."""
        lives, total = [], []
        for _ in range(3):
            start = time.monotonic()
            pid = fork_cli(["patches", "apply", "--target", str(self.target)], self.log)
            first = last = None
            while True:
                if self.journal.exists():
                    last = time.monotonic()
                    first = first or last
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                time.sleep(0.0002)
            total.append(time.monotonic() - start)
            lives.append(last - first if first and last else 0.02)
            self.reset()
        return max(sorted(lives)[1], 0.005), sorted(total)[1]

    def spawn_and_kill(self, signum: int, delay: float, targeted: bool) -> int:
        """Start `apply`; signal it `delay` s after its journal appears (or after start)."""
        pid = fork_cli(["patches", "apply", "--target", str(self.target)], self.log)
        if targeted:
            deadline = time.monotonic() + CHILD_TIMEOUT_S
            while not self.journal.exists() and time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return 0  # finished before the journal was seen: nothing to kill
                time.sleep(0.0002)
        time.sleep(delay)
        os.kill(pid, signum)
        return wait(pid)


def test_sigkill_loop_every_interrupted_tree_is_repaired(tmp_path: Path, capsys):
    loop = Loop(tmp_path)
    window, whole = loop.calibrate()
    rng = random.Random(SEED)
    counts = {"pristine": 0, "patched": 0, "journaled": 0, "torn": 0}
    repaired = {"by-apply": 0, "by-repair": 0}
    leftovers = 0
    unrepairable: list[str] = []
    started = time.monotonic()
    for kill in range(KILLS):
        # Two kills in three land in the write phase (the journal's life), the rest anywhere.
        targeted = kill % 3 != 0
        delay = rng.uniform(0.0, 1.2 * window) if targeted else rng.uniform(0.0, whole)
        loop.spawn_and_kill(signal.SIGKILL, delay, targeted)
        found = loop.state()
        counts[found] += 1
        leftovers += loop.leftovers()
        how = "by-apply" if kill % 2 else "by-repair"
        code, _, err = run(capsys, "patches", how[3:], "--target", loop.target)
        expected = loop.patched if how == "by-apply" or found == "patched" else loop.pristine
        now = watched(loop.target, loop.files)
        if code != 0 or now != expected or loop.journal.exists():
            unrepairable.append(f"kill {kill} ({found}, {how}): exit {code} {err.strip()}")
        elif found in ("journaled", "torn"):
            repaired[how] += 1
        # The whole tree, not only the watched directories, once in a while.
        if kill % 15 == 14:
            whole_now = snapshot(loop.target)
            assert whole_now == (
                loop.full_patched if expected == loop.patched else loop.full_pristine
            )
        loop.reset()
    elapsed = time.monotonic() - started
    result = {
        "release": RELEASE,
        "seed": SEED,
        "kills": KILLS,
        "seconds": round(elapsed, 2),
        "calibration": {"journal_life_s": round(window, 4), "apply_s": round(whole, 4)},
        "found_after_kill": counts,
        "repaired": repaired,
        "temporary_files_left_by_kills": leftovers,
        "unrepairable": len(unrepairable),
        "failures": unrepairable,
    }
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "sigkill.json").write_text(json.dumps(result, indent=2) + "\n")
    assert unrepairable == []
    assert counts["torn"] == 0  # without a journal a tree is always whole
    assert counts["journaled"] > 0, "no kill landed in the write phase: the loop proved nothing"
    held("sigkill-loop")


def test_sigterm_loop_rolls_back_by_itself(tmp_path: Path):
    loop = Loop(tmp_path)
    window, whole = loop.calibrate()
    rng = random.Random(SEED + 1)
    counts = {"pristine": 0, "patched": 0, "journaled": 0, "torn": 0}
    exits: dict[str, int] = {}
    for term in range(TERMS):
        targeted = term % 4 != 0
        delay = rng.uniform(0.0, 1.2 * window) if targeted else rng.uniform(0.0, whole)
        code = loop.spawn_and_kill(signal.SIGTERM, delay, targeted)
        exits[str(code)] = exits.get(str(code), 0) + 1
        counts[loop.state()] += 1
        assert loop.leftovers() == 0
        loop.reset()
    text = loop.log.read_text()
    assert "Traceback" not in text
    assert counts["journaled"] == counts["torn"] == 0, counts
    # Each run either finished (0), was stopped before writing (-15), or rolled back (2).
    assert set(exits) <= {"0", "2", str(-signal.SIGTERM)}, exits
    assert exits.get("2", 0) > 0, f"no SIGTERM landed in the write phase: {exits}"
    assert text.count("interrupted by SIGTERM; tree restored") == exits["2"]
    result = {"terms": TERMS, "found": counts, "exit_codes": exits}
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "sigterm.json").write_text(json.dumps(result, indent=2) + "\n")
    held("sigterm-loop")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_between_two_writes_restores_the_tree(
    signum: int, tmp_path: Path, capsys, monkeypatch
):
    target = trees.clone(RELEASE, tmp_path / "tree")
    before = snapshot(target)
    real = engine._replace
    calls: list[Path] = []

    def signal_after_second(path: Path, text: str | None) -> None:
        real(path, text)
        calls.append(path)
        if len(calls) == 2:  # 0003's first file written, its second not yet
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(engine, "_replace", signal_after_second)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    name = signal.Signals(signum).name
    assert f"interrupted by {name}; tree restored" in one_line_error(code, err)
    assert snapshot(target) == before
    held("sigterm-mid-write" if signum == signal.SIGTERM else "sigint-mid-write")


def test_a_write_error_without_a_file_name_names_the_file(tmp_path: Path, capsys, monkeypatch):
    """write(2) failing with ENOSPC carries no file name: the message must still give one."""
    target = trees.clone(RELEASE, tmp_path / "tree")
    before = snapshot(target)
    real_write = os.write
    writes: list[int] = []
    victim = "vllm/v1/attention/backends/mla/indexer.py"

    def full_disk(descriptor: int, data: bytes) -> int:
        name = os.readlink(f"/proc/self/fd/{descriptor}")
        if Path(victim).name in name:
            writes.append(descriptor)
            raise OSError(28, "No space left on device")  # as the kernel reports it
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", full_disk)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    line = one_line_error(code, err)
    assert writes, "the fault was never injected"
    assert f"cannot write {target / victim}: No space left on device; tree restored" in line
    assert "None" not in line
    assert snapshot(target) == before
    held("write-error-no-filename")


def test_a_file_size_limit_while_journaling_is_one_line(tmp_path: Path):
    """A real kernel refusal (EFBIG from RLIMIT_FSIZE), before any tree file is touched."""
    target = trees.clone(RELEASE, tmp_path / "tree")
    before = snapshot(target)
    code = (
        "import resource, signal, sys; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
        "from mla_serve import cli; sys.exit(cli.main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "patches", "apply", "--target", str(target)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    line = one_line_error(result.returncode, result.stderr)
    assert f"cannot write {target / 'vllm' / journal.JOURNAL}: File too large" in line
    assert "nothing was changed" in line
    assert snapshot(target) == before
    held("journal-too-big")


@pytest.mark.parametrize("case", ["manifest-is-a-directory", "manifest-dir-missing"])
def test_an_unwritable_manifest_rolls_the_tree_back(case: str, tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    before = snapshot(target)
    if case == "manifest-is-a-directory":
        path = tmp_path / "manifest.json"
        path.mkdir()
    else:
        path = tmp_path / "missing" / "manifest.json"
    code, _, err = run(capsys, "patches", "apply", "--target", target, "--manifest", path)
    line = one_line_error(code, err)
    assert f"cannot write {path}" in line and "tree restored" in line
    assert snapshot(target) == before
    held(case)


# ---- concurrency --------------------------------------------------------------------------


def test_concurrent_applies_on_one_tree(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    logs = [tmp_path / f"child-{i}.log" for i in range(8)]
    pids = [fork_cli(["patches", "apply", "--target", str(target)], log) for log in logs]
    codes = [wait(pid) for pid in pids]
    assert set(codes) <= {0, 2}, codes
    assert 0 in codes
    for code, log in zip(codes, logs, strict=True):
        text = log.read_text()
        assert "Traceback" not in text
        if code == 2:
            assert "another mla-serve run is changing" in text, text
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0
    held("concurrent-applies-one-tree")


def test_apply_while_the_lock_is_held_is_refused(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    before = snapshot(target)
    with journal.locked(tree.locate(target)):
        code, _, err = run(capsys, "patches", "apply", "--target", target)
        code_repair, _, err_repair = run(capsys, "patches", "repair", "--target", target)
    assert "another mla-serve run is changing" in one_line_error(code, err)
    assert "another mla-serve run is changing" in one_line_error(code_repair, err_repair)
    assert snapshot(target) == before
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0  # released
    held("lock-held")


def test_applies_sharing_one_manifest_path_do_not_clash(tmp_path: Path):
    shared = tmp_path / "manifest.json"
    targets = [trees.clone(RELEASE, tmp_path / f"tree-{i}") for i in range(4)]
    for _ in range(3):
        logs = [tmp_path / f"child-{i}.log" for i in range(len(targets))]
        pids = [
            fork_cli(["patches", "apply", "--target", str(t), "--manifest", str(shared)], log)
            for t, log in zip(targets, logs, strict=True)
        ]
        assert [wait(pid) for pid in pids] == [0] * len(targets)
        assert all("Traceback" not in log.read_text() for log in logs)
        shared.unlink()
        for t in targets:  # back to pristine for the next round
            for name in series_files(RELEASE):
                journal.replace(t / name, (trees.pristine(RELEASE) / name).read_bytes())
    assert not [p for p in tmp_path.iterdir() if journal.TEMP_MARK in p.name]
    held("shared-manifest-path")


# ---- paths confined to the tree -----------------------------------------------------------


ESCAPE_PATCH = """Description: hostile
---
--- /dev/null
+++ b/{path}
@@ -0,0 +1 @@
+print("outside")
"""


@pytest.mark.parametrize("case", ["series-dotdot", "series-absolute"])
def test_a_series_naming_a_path_outside_the_tree_is_refused(
    case: str, tmp_path: Path, capsys, monkeypatch
):
    pristine = trees.clone(RELEASE, tmp_path / "pristine")
    patched = trees.clone(RELEASE, tmp_path / "patched")
    assert run(capsys, "patches", "apply", "--target", patched)[0] == 0
    before = {t: snapshot(t) for t in (pristine, patched)}
    outside = tmp_path / "escaped.py"
    name = "../escaped.py" if case == "series-dotdot" else str(outside)
    with catalog_with(monkeypatch, tmp_path, RELEASE) as series:
        patch = series / "0001-dcp-workspace-sizing.patch"
        text = ESCAPE_PATCH.format(path=name)
        if case == "series-absolute":
            text = text.replace("+++ b/", "+++ ")
        patch.write_text(patch.read_text() + text)
        for action, target in (("apply", pristine), ("apply", patched), ("verify", patched)):
            code, _, err = run(capsys, "patches", action, "--target", target)
            line = one_line_error(code, err)
            assert "fix dcp-workspace-sizing: 0001-dcp-workspace-sizing.patch refused" in line
            assert f"path {name!r} is not a relative path inside the vLLM tree" in line
    assert not outside.exists()
    assert {t: snapshot(t) for t in (pristine, patched)} == before
    held(case)


def test_a_patched_file_linking_out_of_the_tree_is_refused(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    victim = "vllm/v1/attention/backends/utils.py"
    outside = tmp_path / "elsewhere.py"
    outside.write_bytes((target / victim).read_bytes())
    (target / victim).unlink()
    (target / victim).symlink_to(outside)
    before, outside_before = snapshot(target), digest(outside)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    line = one_line_error(code, err)
    assert f"'{victim}' leaves the vLLM tree" in line
    assert snapshot(target) == before and digest(outside) == outside_before
    held("series-symlink-file")


def test_a_directory_linking_out_of_the_tree_is_refused(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    directory = target / "vllm/models/deepseek_v4"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(directory, elsewhere)
    shutil.rmtree(directory)
    directory.symlink_to(elsewhere, target_is_directory=True)
    outside_before = snapshot(elsewhere)
    code, _, err = run(capsys, "patches", "apply", "--target", target)
    assert "leaves the vLLM tree" in one_line_error(code, err)
    assert snapshot(elsewhere) == outside_before
    held("series-symlink-dir")


@pytest.fixture
def applied(tmp_path: Path) -> Path:
    target = trees.clone(RELEASE, tmp_path / "tree")
    assert cli.main(["patches", "apply", "--target", str(target)]) == 0
    return target


def _manifest(target: Path) -> tuple[Path, dict[str, object]]:
    path = target / "vllm" / manifest.FILENAME
    return path, json.loads(path.read_text())


def _rewrite(path: Path, document: dict[str, object]) -> None:
    path.unlink()
    path.write_text(json.dumps(document))


def test_verify_refuses_a_manifest_naming_dotdot(applied: Path, tmp_path: Path, capsys):
    path, document = _manifest(applied)
    secret = tmp_path / "secret.txt"
    secret.write_text("not vLLM")
    files = document["files"]
    assert isinstance(files, list)
    files.append({"path": "../secret.txt", "sha256_after": digest(secret)})
    _rewrite(path, document)
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert "'../secret.txt' is not a relative path inside the vLLM tree" in one_line_error(
        code, err
    )
    held("manifest-dotdot")


def test_verify_refuses_a_manifest_file_linking_out(applied: Path, tmp_path: Path, capsys):
    path, document = _manifest(applied)
    secret = tmp_path / "secret.txt"
    secret.write_text("not vLLM")
    (applied / "vllm" / "innocent.txt").symlink_to(secret)
    files = document["files"]
    assert isinstance(files, list)
    files.append({"path": "vllm/innocent.txt", "sha256_after": digest(secret)})
    _rewrite(path, document)
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert "leaves the vLLM tree" in one_line_error(code, err)
    held("manifest-symlink")


# ---- verify does not trust the manifest ---------------------------------------------------


def _empty_manifest(target: Path) -> Path:
    found = tree.locate(target)
    series = CATALOG.series(RELEASE)
    path = target / "vllm" / manifest.FILENAME
    path.write_text(
        json.dumps(
            {
                "schema": manifest.SCHEMA,
                "tool": "mla-serve",
                "vllm_version": found.version,
                "vllm_commit": found.commit,
                "release": RELEASE,
                "series": {"patches": list(series.patches), "digest": series.digest},
                "fixes": [],
                "files": [],
            }
        )
    )
    return path


def test_a_manifest_listing_nothing_fails_verify_on_a_pristine_tree(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    _empty_manifest(target)
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1, err
    assert "DRIFT dcp-workspace-sizing: not in the manifest; the catalog says patched" in err
    assert "DRIFT dcp-workspace-sizing: probe fails" in err
    assert "DRIFT series: patches not applied to the tree: 0001-dcp-workspace-sizing.patch" in err
    assert (
        "DRIFT vllm/v1/attention/backends/utils.py: the series changes this file but the "
        "manifest omits it" in err
    )
    held("empty-manifest")


def test_the_entrypoint_refuses_to_start_on_a_forged_manifest(tmp_path: Path):
    """docker/entrypoint.sh with the real `mla-serve` and a pristine 0.27.1 as the vLLM."""
    target = trees.clone(RELEASE, tmp_path / "tree")
    forged = _empty_manifest(target)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "vllm.log"
    (bin_dir / "vllm").write_text(f'#!/bin/sh\necho "vllm $*" >> {log}\n')
    (bin_dir / "vllm").chmod(0o755)
    (bin_dir / "mla-serve").write_text(
        f'#!/bin/sh\nexec {sys.executable} -c "import sys; from mla_serve import cli; '
        f'sys.exit(cli.main(sys.argv[1:]))" "$@"\n'
    )
    (bin_dir / "mla-serve").chmod(0o755)
    result = subprocess.run(
        ["sh", str(ROOT / "docker" / "entrypoint.sh"), "serve", "some/model"],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PYTHONPATH": f"{target}:{ROOT}",  # the vLLM the image would have installed
            "MLA_SERVE_MANIFEST": str(forged),
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "refusing to start" in result.stderr
    assert "DRIFT" in result.stderr and "Traceback" not in result.stderr
    assert not log.exists(), "vLLM was started"
    held("entrypoint-refuses-forged")


def test_a_manifest_claiming_other_statuses_fails_verify(applied: Path, capsys):
    path, document = _manifest(applied)
    fixes = document["fixes"]
    assert isinstance(fixes, list)
    for row in fixes:
        row["status"] = "upstream"
    _rewrite(path, document)
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert code == 1
    assert "DRIFT dcp-workspace-sizing: manifest says upstream, the catalog says patched" in err
    held("manifest-wrong-statuses")


def test_a_patched_trees_manifest_fails_on_a_pristine_tree(applied: Path, tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "pristine")
    shutil.copy(applied / "vllm" / manifest.FILENAME, target / "vllm" / manifest.FILENAME)
    code, _, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1
    assert "DRIFT vllm/v1/attention/backends/utils.py: sha256" in err
    assert "probe fails" in err
    held("manifest-from-other-tree")


# ---- the journal --------------------------------------------------------------------------


def _interrupted(target: Path) -> Path:
    """A pristine tree as SIGKILL would leave it: journal written, 0003 half-applied."""
    found = tree.locate(target)
    plan = engine.plan(found, CATALOG)
    changes = plan.changes
    entries = [journal.Entry(p, (target / p).read_bytes(), t.encode()) for p, t in changes.items()]
    assert entries[1].name == "vllm/v1/attention/backends/utils.py"  # 0003's first file
    journal.begin(found, entries)
    journal.replace(target / entries[0].name, entries[0].after)
    journal.replace(target / entries[1].name, entries[1].after)
    return target / "vllm" / journal.JOURNAL


def test_an_interrupted_apply_is_undone_by_repair_and_completed_by_apply(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    pristine = snapshot(target)
    _interrupted(target)
    code, out, _ = run(capsys, "patches", "repair", "--target", target)
    assert code == 0 and "undid an interrupted apply" in out
    assert snapshot(target) == pristine
    _interrupted(target)
    code, out, _ = run(capsys, "patches", "apply", "--target", target)
    assert code == 0 and "undid an interrupted apply" in out
    assert run(capsys, "patches", "verify", "--target", target)[0] == 0


def test_verify_and_status_report_an_interrupted_apply(applied: Path, capsys):
    victim = "vllm/v1/attention/backends/utils.py"
    original = (trees.pristine(RELEASE) / victim).read_bytes()
    entry = journal.Entry(victim, original, (applied / victim).read_bytes())
    journal.begin(tree.locate(applied), [entry])
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert code == 1
    assert "DRIFT journal: an apply was interrupted" in err
    code, _, err = run(capsys, "patches", "status", "--target", applied)
    assert code == 0 and "run `mla-serve patches repair`" in err
    held("journal-detected-by-verify")


def test_a_damaged_journal_is_refused_and_nothing_is_touched(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    path = _interrupted(target)
    document = json.loads(path.read_text())
    document["entries"][0]["before"] = "AAAA"  # the digest no longer matches
    path.write_text(json.dumps(document))
    before = snapshot(target)
    for action in ("repair", "apply"):
        code, _, err = run(capsys, "patches", action, "--target", target)
        assert "is damaged" in one_line_error(code, err)
    assert snapshot(target) == before
    held("journal-damaged")


def test_a_journal_naming_an_outside_file_needs_that_manifest(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    outside = tmp_path / "victim.txt"
    outside.write_text("patched")
    found = tree.locate(target)
    journal.begin(found, [journal.Entry(str(outside), b"evil", b"patched")])
    code, _, err = run(capsys, "patches", "repair", "--target", target)
    assert f"run again with --manifest {outside}" in one_line_error(code, err)
    assert outside.read_text() == "patched"
    # Named explicitly (it was this run's manifest), the journal is followed.
    code, out, err = run(capsys, "patches", "repair", "--target", target, "--manifest", outside)
    assert "is as it was before the interrupted apply" in out
    assert outside.read_text() == "evil"
    # What it restored is no manifest, so repair cannot check the files against it.
    assert f"cannot read manifest {outside}" in one_line_error(code, err)
    held("journal-outside-manifest")


# ---- bad bytes, raising probes, bad manifests ---------------------------------------------


def test_a_target_file_that_is_not_utf8_is_one_line(applied: Path, capsys):
    victim = applied / "vllm/v1/attention/backends/utils.py"
    data = victim.read_bytes()
    victim.unlink()
    victim.write_bytes(b"\xff\xfe" + data)
    for action in ("apply", "status", "verify"):
        code, _, err = run(capsys, "patches", action, "--target", applied)
        assert f"{victim} is not UTF-8 text" in one_line_error(code, err), action
    held("non-utf8-target")


def test_a_probe_that_raises_fails_closed(tmp_path: Path, capsys):
    """0.33.0 ships every fix; a drifted constant makes the workspace probe's code raise."""
    target = trees.clone("0.33.0", tmp_path / "tree")
    assert run(capsys, "patches", "apply", "--target", target)[0] == 0
    path = target / "vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py"
    source = path.read_text()
    assert source.count("_TRTLLM_GEN_SOFTMAX_SLOTS_PER_TOKEN = 256") == 1
    trees.edit(path, source.replace("_TRTLLM_GEN_SOFTMAX_SLOTS_PER_TOKEN = 256", "_X = 1 // 0"))
    code, out, err = run(capsys, "patches", "verify", "--target", target)
    assert code == 1 and "Traceback" not in err
    assert "DRIFT dcp-workspace-sizing: probe fails: probe raised" in err
    code, out, err = run(capsys, "patches", "status", "--target", target)
    assert code == 1 and "Traceback" not in err
    assert "MISSING dcp-workspace-sizing (upstream): probe fail: probe raised" in err
    row = next(line for line in out.splitlines() if line.startswith("dcp-workspace-sizing"))
    assert "upstream:fail" in row
    held("probe-raises")


def test_a_manifest_of_the_wrong_shape_is_one_line(applied: Path, capsys):
    path, document = _manifest(applied)
    document["fixes"] = "all of them"
    _rewrite(path, document)
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert "is not an mla-serve manifest" in one_line_error(code, err)
    path.unlink()
    path.write_bytes(b"\xff{}")
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    assert "cannot read manifest" in one_line_error(code, err)
    held("manifest-wrong-shape")


@pytest.mark.parametrize("case", ["tampered-version", "tampered-digest", "tampered-schema"])
def test_a_tampered_manifest_is_caught(case: str, applied: Path, capsys):
    path, document = _manifest(applied)
    series = document["series"]
    assert isinstance(series, dict)
    if case == "tampered-version":
        document["vllm_version"] = "0.33.0"
    elif case == "tampered-digest":
        series["digest"] = "0" * 64
    else:
        document["schema"] = 99
    _rewrite(path, document)
    code, _, err = run(capsys, "patches", "verify", "--target", applied)
    if case == "tampered-schema":
        assert "is not an mla-serve manifest" in one_line_error(code, err)
    else:
        assert code == 1 and "Traceback" not in err
        word = "version" if case == "tampered-version" else "series"
        assert f"DRIFT {word}: " in err
    held(case)


def test_an_immutable_file_mid_series_is_a_real_write_error(tmp_path: Path, capsys):
    """rename(2) over an immutable file fails (EPERM) after two files were replaced."""
    target = trees.clone(RELEASE, tmp_path / "tree")
    victim = target / "vllm/v1/attention/backends/mla/indexer.py"  # 0003's second file
    data = victim.read_bytes()
    victim.unlink()  # its own inode: the flag must not reach the shared cache
    victim.write_bytes(data)
    flagged = subprocess.run(["chattr", "+i", str(victim)], capture_output=True, text=True)
    if flagged.returncode != 0:
        pytest.skip(f"chattr +i needs root and an ext4-like file system: {flagged.stderr}")
    try:
        before = snapshot(target)
        code, _, err = run(capsys, "patches", "apply", "--target", target)
        line = one_line_error(code, err)
        assert f"cannot write {victim}: Operation not permitted; tree restored" in line
        assert snapshot(target) == before
    finally:
        subprocess.run(["chattr", "-i", str(victim)], check=True)
    held("immutable-file")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A private tmpfs: a file system that really fills up."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160m,mode=0755", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def _free(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def test_a_full_disk_at_every_point_of_apply(small_disk: Path, capsys):
    """Fill the disk to leave N bytes free, apply, repeat over N: every run either completes
    or fails naming the file, with the tree byte for byte as it was."""
    target = small_disk / "tree"
    shutil.copytree(trees.pristine(RELEASE), target, ignore=shutil.ignore_patterns("__pycache__"))
    files = series_files(RELEASE)
    pristine = {f: (target / f).read_bytes() for f in files}
    plan = engine.plan(tree.locate(target), CATALOG)
    volume = sum(len(t or "") for t in plan.result.values()) + sum(map(len, pristine.values()))
    # The manifest is written and journaled too; it records the originals of the files.
    volume += len(manifest.render(manifest.build(plan, engine.check(plan, CATALOG))))
    upper = volume * 2 + 256 * 1024  # the journal holds both, base64: about 1.4 x volume
    before = watched(target, files)
    filler = small_disk / "filler"
    outcomes: dict[str, int] = {}

    def attempt(wanted: int) -> str:
        filler.unlink(missing_ok=True)
        with filler.open("wb") as handle:
            size = max(_free(small_disk) - wanted, 0)
            chunk = b"\0" * (1 << 20)
            while size > 0:
                size -= handle.write(chunk[: min(size, len(chunk))])
        code, _, err = run(capsys, "patches", "apply", "--target", target)
        if code == 0:
            outcome = "complete"
            assert run(capsys, "patches", "verify", "--target", target)[0] == 0
        else:
            line = one_line_error(code, err)
            assert "None" not in line and "No space left on device" in line, line
            assert watched(target, files) == before, line  # restored, nothing left over
            name = line.split("cannot write ", 1)[1].split(":", 1)[0]
            outcome = f"failed at {Path(name).name}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        filler.unlink()
        for name, data in pristine.items():  # back to pristine for the next step
            journal.replace(target / name, data)
        (target / "vllm" / manifest.FILENAME).unlink(missing_ok=True)
        return outcome

    # Coarse over the whole range, then page by page from the last failure at the journal.
    steps = 12
    last_journal_failure = 0
    for step in range(steps + 1):
        wanted = upper * step // steps
        if attempt(wanted) == f"failed at {journal.JOURNAL}":
            last_journal_failure = wanted
    page = os.statvfs(small_disk).f_frsize
    for offset in range(32):
        attempt(last_journal_failure + offset * page)
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "full-disk.json").write_text(
        json.dumps(
            {"runs": sum(outcomes.values()), "max_free_bytes": upper, "outcomes": outcomes},
            indent=2,
        )
        + "\n"
    )
    assert outcomes.get("complete", 0) > 0
    assert outcomes.get(f"failed at {journal.JOURNAL}", 0) > 0
    later = [o for o in outcomes if o.startswith("failed at") and journal.JOURNAL not in o]
    assert later, f"no run failed after the journal: {outcomes}"
    held("full-disk-sweep")


def test_a_repair_that_cannot_restore_keeps_the_journal(tmp_path: Path, capsys):
    target = trees.clone(RELEASE, tmp_path / "tree")
    pristine = snapshot(target)
    path = _interrupted(target)  # utils.py already holds its patched bytes
    victim = target / "vllm/v1/attention/backends/utils.py"
    flagged = subprocess.run(["chattr", "+i", str(victim)], capture_output=True, text=True)
    if flagged.returncode != 0:
        pytest.skip(f"chattr +i needs root and an ext4-like file system: {flagged.stderr}")
    try:
        code, _, err = run(capsys, "patches", "repair", "--target", target)
        assert f"cannot write {victim}: Operation not permitted" in one_line_error(code, err)
        assert path.exists()
    finally:
        subprocess.run(["chattr", "-i", str(victim)], check=True)
    assert run(capsys, "patches", "repair", "--target", target)[0] == 0
    assert snapshot(target) == pristine
    held("repair-cannot-write")
