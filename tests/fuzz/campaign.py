"""`make fuzz`: every fuzz target for a while, its corpus kept minimized in the repository.

    .venv/bin/python -m tests.fuzz.campaign --seconds 300 [--targets "frames lane"] [--asan]

For each target: libFuzzer runs (run.py) for `--seconds` on the kept corpus
(tests/fuzz/corpus/TARGET) and a working one (build/fuzz/work/TARGET), against a build of
the C lane made for it in build/fuzz: with GCC's `-fsanitize-coverage=trace-cmp` (its
comparisons steer libFuzzer, `-use_value_profile=1`), or with `--asan` AddressSanitizer
(preloaded: a bad read or write in the lane is a crash; the comparisons are then
AddressSanitizer's, unseen by libFuzzer). Then both corpora are merged into the smallest set
of inputs with the same coverage (of the Python code, h11's included; for `frames` also of
the values the lane compared), which replaces the kept one. A crash leaves its input in
build/fuzz/TARGET-crash-…, and the campaign fails naming it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hatch_build

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
BUILD = ROOT / "build" / "fuzz"
TARGETS = ("frames", "lane", "head_refusal", "protocol")
# Inputs up to: a few chunks (frames), a stream's reads (lane), a few requests (protocol).
MAX_LEN = {"frames": 2048, "lane": 4096, "head_refusal": 512, "protocol": 2048}
# Kept by the values the lane compared, not only by code covered: the lane's own test (in C,
# whose branches libFuzzer does not see).
BY_VALUES = {"frames"}


def build_lane(asan: bool) -> Path:
    out = BUILD / ("_lane-asan.abi3.so" if asan else "_lane-cmp.abi3.so")
    flags = ["-g", "-O1"]
    if asan:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    else:
        flags += ["-fsanitize-coverage=trace-cmp", str(ROOT / "tests/fuzz/coverage_stubs.c")]
    hatch_build.compile_lane(ROOT, out, tuple(flags))
    return out


def environment(target: str, lane: Path, asan: bool) -> dict[str, str]:
    env = {**os.environ, "FUZZ_TARGET": target, "FUZZ_LANE": str(lane)}
    if asan:
        runtime = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                                 text=True, check=True).stdout.strip()  # fmt: skip
        env.update(LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=1")
    return env


def fuzz(target: str, seconds: int, lane: Path, asan: bool) -> bool:
    """One target's run and merge; whether it found nothing."""
    kept, work = CORPUS / target, BUILD / "work" / target
    kept.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = environment(target, lane, asan)
    command = [sys.executable, "-m", "tests.fuzz.run", "-timeout=30",
               f"-max_len={MAX_LEN.get(target, 4096)}",
               f"-artifact_prefix={BUILD}/{target}-"]  # fmt: skip
    print(f"== {target}: {seconds} s", flush=True)
    run = subprocess.run([*command, "-use_value_profile=1", f"-max_total_time={seconds}",
                          str(work), str(kept)], cwd=ROOT, env=env, check=False)  # fmt: skip
    merged = BUILD / "merged" / target
    shutil.rmtree(merged, ignore_errors=True)
    merged.mkdir(parents=True)
    profile = ["-use_value_profile=1"] if target in BY_VALUES else []
    subprocess.run([*command, *profile, "-merge=1", str(merged), str(kept), str(work)], cwd=ROOT,
                   env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)  # fmt: skip
    for old in kept.iterdir():
        old.unlink()
    for new in merged.iterdir():
        shutil.copy(new, kept / new.name)
    size = sum(path.stat().st_size for path in kept.iterdir())
    print(f"== {target}: corpus {len(list(kept.iterdir()))} inputs, {size} bytes", flush=True)
    return run.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60, help="per target")
    parser.add_argument("--targets", default=" ".join(TARGETS))
    parser.add_argument("--asan", action="store_true", help="the lane with AddressSanitizer")
    args = parser.parse_args()
    lane = build_lane(args.asan)
    failed = [t for t in args.targets.split() if not fuzz(t, args.seconds, lane, args.asan)]
    if failed:
        crashes = sorted(str(path) for path in BUILD.glob("*-crash-*"))
        sys.exit(f"fuzz: {', '.join(failed)} found a crash: {', '.join(crashes)}")
    print(f"fuzz: {args.targets}: nothing found in {args.seconds} s each")


if __name__ == "__main__":
    main()
