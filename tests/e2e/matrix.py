"""Run end-to-end stacks, several at a time: release x layout x pristine/patched.

    python -m tests.e2e.matrix --store DIR --results DIR SPEC [SPEC ...]   # from the repo root

SPEC is `release:layout:state`, e.g. `0.29.0:b200-tp1-pcp4-dcp4:pristine`; the layouts
are the pack's layouts.json (the Helm profiles' command lines, tests/e2e/layouts.py).
The store is what `run.sh unpack` laid out: vllm-<release>/ (tree, CuTe DSL, wheels),
ext-<release>/ (its MoE and KDA modules), deps-<version>/ (the CuTe DSL's libraries,
TileLang), flashinfer-<version>/ (the image's FlashInfer), common/ (wheels, models,
layouts.json).

Per stack: its own copy of the release's tree (the fix series applied by `mla-serve
patches apply`, as the image build does, or left pristine), ports, HOME and GPUs.
Stacks start `--stagger` seconds apart, at most `--parallel` at a time, on
CUDA_VISIBLE_DEVICES chosen by width. Where a release's own DeepGEMM binding does
not load under the machine's torch, its stacks get the test-only stand-in
(tests/e2e/standins/deep_gemm) and the results say so. DCP layouts run with vLLM's
own GPU<->CPU sync check in warn mode (VLLM_GPU_SYNC_CHECK=warn): every synchronizing
operation in a step is logged with its file and line, which is how the per-step
host-to-device copy of dcp-rank-device-tensor shows.

Results per stack in RESULTS/<release>-<layout>-<state>/ (summary.json, junit.xml,
status.json, logs), and RESULTS/matrix.json: one line per stack.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e import report
from tests.e2e.stack import Stack

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

STANDINS = HERE / "standins"
BINDING_CHECK = "import vllm.third_party.deep_gemm"


def site_paths(store: Path, release: str) -> list[str]:
    """What the release's processes import besides its tree: the CuTe DSL and quack at its
    pins (one site directory per DSL version), FlashInfer at the image's pin, the light
    wheels."""
    meta = json.loads((store / f"vllm-{release}" / "pack.json").read_text())
    site = store / f"deps-{meta['cute_dsl_version']}" / "site"
    flashinfer = meta.get("flashinfer_carry")
    # The DSL's .pth adds dsl_packages, but only site directories read .pth files. The
    # checkout comes first: the carried mla-serve wheel in common/site gives the entry
    # points (console script, vLLM plugin), the code under test is this checkout's.
    return [
        str(ROOT),
        str(site),
        str(site / "nvidia_cutlass_dsl" / "dsl_packages"),
        *([str(store / flashinfer["name"] / "site")] if flashinfer else []),
        str(store / "common" / "site"),
    ]


def deep_gemm_loads(tree: Path, paths: list[str]) -> tuple[bool, str]:
    probe = subprocess.run(
        [sys.executable, "-c", BINDING_CHECK],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *paths])),
        timeout=300,
    )
    last = (probe.stderr.strip().splitlines() or [""])[-1]
    return probe.returncode == 0, last


def missing_carries(store: Path, release: str) -> list[str]:
    """The release's carries `run.sh unpack` has not laid out in the store yet."""
    meta = json.loads((store / f"vllm-{release}" / "pack.json").read_text())
    missing = []
    extension = meta.get("extension_carry")
    if extension and not (store / extension["name"] / "tree").is_dir():
        missing.append(extension["name"])
    flashinfer = meta.get("flashinfer_carry")
    if flashinfer and not (store / flashinfer["name"] / "site").is_dir():
        missing.append(flashinfer["name"])
    return missing


def prepare(store: Path, work: Path, release: str, state: str) -> tuple[Path, dict[str, Any]]:
    """The stack's own tree: hard-linked from the store (the engine replaces files, never
    writes into them) with the release's extension carry laid over it, then patched by
    `mla-serve patches apply` unless pristine."""
    tree = work / "tree"
    shutil.copytree(store / f"vllm-{release}" / "tree", tree, copy_function=os.link)
    meta = json.loads((store / f"vllm-{release}" / "pack.json").read_text())
    if extension := meta.get("extension_carry"):
        shutil.copytree(
            store / extension["name"] / "tree", tree, copy_function=os.link, dirs_exist_ok=True
        )
    notes: dict[str, Any] = {}
    if state == "patched":
        applied = subprocess.run(
            [sys.executable, "-m", "mla_serve.cli", "patches", "apply", "--target", str(tree)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        notes["patches_apply"] = {
            "rc": applied.returncode,
            "output": applied.stdout[-4000:] + applied.stderr[-2000:],
        }
        if applied.returncode != 0:
            raise RuntimeError(f"patches apply failed: {applied.stderr.strip()[-500:]}")
    return tree, notes


def expect(release: str, layout: dict[str, Any], state: str) -> str:
    """ "fails" for a pristine tree on a layout that reaches a bug the series fixes on Hopper.

    On an H200 the DCP fixes are the reachable ones (dcp-empty-shard-mask,
    dcp-rank-device-tensor); the others need SM100 (FlashInfer's sparse MLA), PCP
    with DCP, or DeepSeek-V4.
    """
    from mla_serve.patching import catalog

    if state != "pristine" or layout["parallel"]["dcp"] < 2:
        return "serves"
    fixes = catalog.load().fixes
    patched = {fix.id for fix in fixes if fix.on(release).status is catalog.Status.PATCHED}
    return "fails" if patched & HOPPER_DCP_FIXES else "serves"


HOPPER_DCP_FIXES = {"dcp-empty-shard-mask", "dcp-rank-device-tensor"}


class Gpus:
    """Hands out CUDA_VISIBLE_DEVICES by width; several small stacks share a GPU."""

    def __init__(self, count: int) -> None:
        self.count, self.next = count, 0

    def take(self, width: int) -> str:
        if width >= self.count:
            return ",".join(str(i) for i in range(width))
        chosen = [(self.next + i) % self.count for i in range(width)]
        self.next = (self.next + width) % self.count
        return ",".join(str(i) for i in chosen)


def run_one(stack: Stack, results: Path, timeout: float, lines: list[dict[str, Any]]) -> None:
    out = results / stack.name
    out.mkdir(parents=True, exist_ok=True)
    line: dict[str, Any] = {
        "stack": stack.name,
        "release": stack.release,
        "layout": stack.layout["profile"],
        "state": stack.state,
        "parallel": stack.layout["parallel"],
        "gpus": stack.gpus,
    }
    try:
        stack.start()
        outcome = stack.watch(timeout)
        line["startup"] = outcome
        line["tests_rc"] = stack.test(out) if not outcome.startswith("not up") else None
    except Exception as error:  # the matrix goes on; the line says what broke
        line["error"] = f"{type(error).__name__}: {error}"
    finally:
        stack.stop()
        time.sleep(2)  # let the GPU memory go before the next stack takes it
        line.update(report.write(stack.work, out, stack.record))
        lines.append(line)
        print(f"== {stack.name}: {line.get('verdict')}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument(
        "--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "mla-serve-e2e-work"
    )
    parser.add_argument("--parallel", type=int, default=3)
    parser.add_argument("--stagger", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=420.0)
    parser.add_argument("--gpus", type=int, default=0, help="default: torch.cuda.device_count()")
    parser.add_argument("specs", nargs="+", help="release:layout:state")
    args = parser.parse_args()
    store, results = args.store.resolve(), args.results.resolve()
    layouts = json.loads((store / "common" / "layouts.json").read_text())
    gpu_count = args.gpus or int(
        subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    gpus = Gpus(gpu_count)
    shutil.rmtree(args.work, ignore_errors=True)
    results.mkdir(parents=True, exist_ok=True)
    binding: dict[str, tuple[bool, str]] = {}
    stacks: list[Stack] = []
    lines: list[dict[str, Any]] = []
    for spec in args.specs:  # every spec checked before anything starts
        parts = spec.split(":")
        if len(parts) != 3 or parts[1] not in layouts or parts[2] not in ("patched", "pristine"):
            parser.error(
                f"{spec!r} is not release:layout:state (layouts: {', '.join(sorted(layouts))};"
                " states: patched, pristine)"
            )
        if not (store / f"vllm-{parts[0]}" / "pack.json").is_file():
            parser.error(f"{spec!r}: no vllm-{parts[0]} in {store}: run 'run.sh unpack' first")
        for missing in missing_carries(store, parts[0]):
            parser.error(f"{spec!r}: no {missing} in {store}: run 'run.sh unpack' on it first")
    for index, spec in enumerate(args.specs):
        release, name, state = spec.split(":")
        layout = layouts[name]
        work = args.work / f"{release}-{name}-{state}"
        work.mkdir(parents=True)
        paths = site_paths(store, release)
        try:
            tree, notes = prepare(store, work, release, state)
        except Exception as error:
            lines.append({"stack": work.name, "error": str(error), "verdict": "not started"})
            continue
        if release not in binding:
            binding[release] = deep_gemm_loads(tree, paths)
            print(
                f"vLLM {release}: DeepGEMM's binding "
                f"{'loads' if binding[release][0] else 'fails: ' + binding[release][1]}"
            )
        # "warn", not "error": vLLM's own DCP prefill metadata syncs (`.item()` in the
        # indexer's build_prefill_chunk_metadata, 0.29.0 to 0.33.0), which "error" turns
        # into a dead engine. The warnings name file and line; tests/e2e looks for the one
        # dcp-rank-device-tensor is about (get_dcp_local_seq_lens) and the results list all.
        env = {"VLLM_GPU_SYNC_CHECK": "warn"} if layout["parallel"]["dcp"] > 1 else {}
        if not binding[release][0]:
            paths = [str(STANDINS), *paths]
            # The stand-in shadows the release's vendored DeepGEMM on purpose: the entrypoint's
            # check (`mla-serve patches deep-gemm`) would rightly refuse it otherwise.
            env["MLA_SERVE_ALLOW_EXTERNAL_DEEP_GEMM"] = "1"
            notes["deep_gemm"] = (
                "TEST-ONLY STAND-IN tests/e2e/standins/deep_gemm: the release's "
                f"binding fails to load ({binding[release][1]})"
            )
        model = store / "common" / layout["model_dir"]
        if layout["gpus"] > gpu_count:
            lines.append(
                {
                    "stack": work.name,
                    "as_expected": True,  # not a failure: no GPUs
                    "verdict": f"skipped: needs {layout['gpus']} GPUs, {gpu_count} here",
                }
            )
            continue
        stack = Stack(
            name=work.name,
            release=release,
            layout=layout,
            state=state,
            tree=tree,
            model=model,
            work=work,
            index=index,
            gpus=gpus.take(layout["gpus"]),
            env=env,
            paths=paths,
            notes=notes,
            expect=expect(release, layout, state),
        )
        stacks.append(stack)
    threads: list[threading.Thread] = []
    for stack in stacks:
        while sum(t.is_alive() for t in threads) >= args.parallel:
            time.sleep(1)
        thread = threading.Thread(target=run_one, args=(stack, results, args.timeout, lines))
        thread.start()
        threads.append(thread)
        time.sleep(args.stagger)
    for thread in threads:
        thread.join()
    lines.sort(key=lambda line: str(line.get("stack")))
    (results / "matrix.json").write_text(json.dumps(lines, indent=2) + "\n")
    for line in lines:
        print(f"{line.get('stack')}: {line.get('verdict')}")
    return 0 if all(line.get("as_expected") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
