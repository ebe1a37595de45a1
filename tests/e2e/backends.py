"""`make e2e-backends`: the sparse-MLA attention backends of GLM-5.3 on Hopper, side by side
on the live engine.

    python -m tests.e2e.backends --store STORE --results DIR [--spec RELEASE:gb300-tp4@1:patched]
    python -m tests.e2e.backends table backends.json          # the markdown again

(from the repository root, on the GPU machine: run.sh backends)

On SM90 vLLM 0.33.0 (platforms/cuda.py) tries FLASHINFER_MLA_SPARSE_SM90 first for MLA head
size 512 (GLM-5.3's NoPE MLA) where FlashInfer has its SM90 NoPE kernel (0.7.2.post1, the
image's, has), then FLASH_ATTN_MLA_SPARSE, then FLASHMLA_SPARSE. vllm#56564 reports the first
36-70 % slower than FLASH_ATTN_MLA_SPARSE for GLM-5.3-Flash on Hopper.

One stack per backend, as `make e2e` starts the spec's layout (the tiny GLM-5.3, the image's
entrypoint, CUDA graphs on, the fix series applied) with `--attention-backend` set and
`--max-num-seqs` raised to the highest concurrency; all on this machine's GPU (each with the
layout's fixed KV cache), started together and measured one at a time, direct to vLLM. Which
backend each rank really runs is read from its sidecar's /status. At each concurrency
(1, 16, 64) the rounds interleave the backends (bench.py's Bench: each backend the same
requests in one round, the order rotated per round, an untimed warm-up first): streaming chat
completions of `--max-tokens` tokens after a prompt of about `--prompt-words` words, every reply
run to max_tokens, after one untimed pass per backend at each concurrency. Decode step time:
vLLM's own mean time between a stream's tokens over the round (its inter-token histogram; at c
streams one step makes one token of each); throughput: output tokens/s (usage).
Each against the reference backend (FLASH_ATTN_MLA_SPARSE) in the same round.

FlashInfer builds its SM90 sparse-MLA kernels at first use (into run.sh's store); cold, with
three stacks compiling and capturing at once, that stack is not up within a 600 s device call.
Run it after `run.sh serve` of the GLM-5.3 stack on the same machine (`make e2e` then
`make e2e-backends`), which leaves the kernels built.

Results: DIR/backends.json, DIR/backends.md, each stack's logs. Exit 1 when a stack did not
start, ran another backend than asked, or a request failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from mla_serve.patching import catalog
from tests import scrape
from tests.e2e import bench
from tests.e2e.model import MODELS

BACKENDS = ("FLASHINFER_MLA_SPARSE_SM90", "FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE")
REFERENCE = "FLASH_ATTN_MLA_SPARSE"  # the report's faster one
KEYS = ("engine_itl_mean_ms", "engine_ttft_mean_ms", "output_tokens_per_s")
ITL, TTFT = "vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds"
PROMPT = (
    "Sparse attention selects, for every query token, the few cached tokens that matter "
    "most, so the cost of a step grows with the selection and not with the context. "
)


def stacks_for(args: argparse.Namespace, work: Path) -> list[Any]:
    """One stack of `--spec` per backend, each with its own ports and work directory."""
    from tests.e2e import matrix
    from tests.e2e.stack import Stack

    store = args.store.resolve()
    release, name, state = args.spec.split(":")
    layouts = json.loads((store / "common" / "layouts.json").read_text())
    if name not in layouts or state not in ("patched", "pristine"):
        raise ValueError(f"--spec {args.spec!r}: layouts {', '.join(sorted(layouts))}")
    if missing := matrix.missing_carries(store, release):
        raise ValueError(f"--spec {args.spec!r}: run 'run.sh unpack' on {', '.join(missing)}")
    layout = layouts[name]
    if layout["attention_backend"]:
        raise ValueError(f"--spec {args.spec!r} sets --attention-backend itself")
    highest = max(args.level_list)
    stacks = []
    for index, backend in enumerate(args.backends):
        own = json.loads(json.dumps(layout))
        own["argv"] = [a for a in own["argv"] if not a.startswith("--max-num-seqs")]
        own["argv"] += [f"--max-num-seqs={highest}", f"--attention-backend={backend}"]
        folder = work / backend
        folder.mkdir(parents=True)
        paths = matrix.site_paths(store, release)
        tree, notes = matrix.prepare(store, folder, release, state)
        loads, why = matrix.deep_gemm_loads(tree, paths)
        if not loads:
            paths = [str(matrix.STANDINS), *paths]
            notes["deep_gemm"] = f"TEST-ONLY STAND-IN tests/e2e/standins/deep_gemm ({why})"
        stack = Stack(
            name=f"{release}-{name}-{state}-{backend}", release=release, layout=own,
            state=state, tree=tree, model=store / "common" / layout["model_dir"],
            work=folder, index=index, gpus="0", paths=paths, notes=notes,
        )  # fmt: skip
        stacks.append(stack)
    return stacks


def ranks_of(admin_url: str) -> dict[str, Any]:
    """Each engine rank's attention backends and CUDA graph mode, from the sidecar's /status."""
    with urllib.request.urlopen(f"{admin_url}/status", timeout=10) as response:
        status = json.load(response)
    found = {}
    for rank in (status.get("engine") or {}).get("ranks") or []:
        figures = {name: figure.get("value") for name, figure in rank["figures"].items()}
        found[str(rank["rank"])] = {
            "attention_backends": figures.get("attention_backends"),
            "cudagraph_mode": figures.get("cudagraph_mode"),
        }
    return found


class EngineBench(bench.Bench):
    """The live benchmark's rounds, with vLLM's own time between tokens per round: the
    sum and count of its `vllm:inter_token_latency_seconds` histogram around the timed
    requests. vLLM 0.33.0 streams no reasoning chunk while the reasoning runs on (GLM-5.3
    always thinks, and `</think>` is ruled out so every reply runs to max_tokens), so the
    client sees no gaps; the engine measures every one."""

    def before_run(self, path: bench.Path_) -> dict[str, Any]:
        return histograms(path.url)

    def after_run(self, path: bench.Path_, before: dict[str, Any]) -> dict[str, Any]:
        after = histograms(path.url)
        out: dict[str, Any] = {}
        for name, key in ((ITL, "engine_itl_mean_ms"), (TTFT, "engine_ttft_mean_ms")):
            total, count = (after[name][i] - before[name][i] for i in (0, 1))
            out[key] = round(total / count * 1e3, 3) if count > 0 else None
        return out


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """Sum and count of vLLM's inter-token and first-token histograms (all label sets)."""
    found = scrape.samples(url)
    return {
        name: (
            sum(value for _, value in found.get(f"{name}_sum", [])),
            sum(value for _, value in found.get(f"{name}_count", [])),
        )
        for name in (ITL, TTFT)
    }


def bodies(words: int, max_tokens: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The live benchmark's request (bench.live_bodies: EOS and `</think>` ruled out, so every
    reply runs to max_tokens) with a prompt of about `words` words."""
    (body, _), warmup = bench.live_bodies(max_tokens, MODELS["glm-5.3-flash"])
    prompt = (PROMPT * math.ceil(words / len(PROMPT.split())))[: 8 * words]
    body["messages"] = [{"role": "user", "content": prompt}]
    return [body], warmup


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per backend: the figures over rounds (median [min..max], 95 % interval from 6 rounds);
    against the reference in the same round: step time and throughput ratios."""
    out: dict[str, Any] = {}
    for name in {n for entry in rounds for n in entry["paths"]}:
        mine = [e["paths"][name] for e in rounds if name in e["paths"]]
        summary = {
            key: bench.band([r[key] for r in mine if r.get(key) is not None]) for key in KEYS
        }
        pairs = [(e["paths"][REFERENCE], e["paths"][name]) for e in rounds
                 if REFERENCE in e["paths"] and name in e["paths"]]  # fmt: skip
        for key in ("engine_itl_mean_ms", "output_tokens_per_s"):
            summary[f"{key}_vs_reference"] = bench.band(
                [r[key] / ref[key] for ref, r in pairs if r.get(key) and ref.get(key)], 4
            )
        out[name] = summary
    return out


def cell(b: dict[str, Any], digits: int = 2) -> str:
    return bench.cell(b, digits) if b else "-"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"# Sparse-MLA attention backends, {result.get('what', '')}",
        "",
        f"Started {result.get('started_at')}, {result.get('elapsed_s')} s. Per concurrency and "
        "backend: median [min..max] over rounds; ratios against "
        f"{REFERENCE} in the same round (step time: lower is faster; throughput: higher is).",
        "",
    ]
    for name, stack in result.get("stacks", {}).items():
        ranks = ", ".join(
            f"rank {r}: {'/'.join(f['attention_backends'] or ['?'])} ({f['cudagraph_mode']})"
            for r, f in (stack.get("ranks") or {}).items()
        )
        lines.append(f"- {name}: {stack.get('startup')} after {stack.get('startup_s')} s; "
                     f"{ranks or 'no ranks reported'}")  # fmt: skip
    lines += [
        "",
        "| streams | backend | decode step ms (vLLM's mean ITL) | vs reference "
        "| TTFT mean ms | output tok/s | vs reference |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {level: summarize(entries) for level, entries in result.get("series", {}).items()}
    for level, per in sorted(summary.items(), key=lambda kv: int(kv[0])):
        for name in [b for b in BACKENDS if b in per] + sorted(set(per) - set(BACKENDS)):
            s = per[name]
            lines.append(
                f"| {level} | {name} | {cell(s['engine_itl_mean_ms'], 3)} "
                f"| {cell(s['engine_itl_mean_ms_vs_reference'], 3)} "
                f"| {cell(s['engine_ttft_mean_ms'], 1)} | {cell(s['output_tokens_per_s'], 0)} "
                f"| {cell(s['output_tokens_per_s_vs_reference'], 3)} |"
            )
    problems = result.get("problems") or []
    lines += ["", "Problems: " + ("; ".join(problems) if problems else "none"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["table"]:
        if len(argv) != 2:
            print("usage: python -m tests.e2e.backends table backends.json", file=sys.stderr)
            return 2
        sys.stdout.write(table(json.loads(Path(argv[1]).read_text())))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="run.sh's store")
    parser.add_argument("--spec", default=f"{catalog.load().default}:gb300-tp4@1:patched",
                        help="release:layout:state (default: %(default)s)")  # fmt: skip
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "mla-serve-e2e-backends-work",
    )
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--rounds", default="1=4,16=4,64=4", help="the most rounds per level")
    parser.add_argument("--requests", default="1=4,16=32,64=64",
                        help="requests per backend per round")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, default=1000)
    parser.add_argument("--budget-s", type=float, default=580.0,
                        help="wall time of the whole run, start-up included")  # fmt: skip
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=450.0,
        help="start-up wait per stack (a cold FlashInfer JIT takes minutes)",
    )
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        args.level_list = [int(c) for c in args.levels.split(",") if c.strip()]
        rounds = bench.parse_map(args.rounds, "rounds")
        requests = bench.parse_map(args.requests, "requests")
    except ValueError as error:
        parser.error(str(error))
    if REFERENCE not in args.backends:
        parser.error(f"--backends must include the reference, {REFERENCE}")
    if missing := [c for c in args.level_list if c not in rounds or c not in requests]:
        parser.error(f"--rounds and --requests need every level of --levels ({missing})")
    results, work = args.results.resolve(), args.work.resolve()
    if results == work or work in results.parents or results in work.parents:
        parser.error(f"--work {work} and --results {results} must not overlap (--work is wiped)")
    results.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    problems: list[str] = []
    stacks: list[Any] = []
    clients: bench.Clients | None = None
    measured: EngineBench | None = None
    try:
        stacks = stacks_for(args, work)
        for stack in stacks:
            stack.start()
            time.sleep(5)  # their compiles and captures overlap; their polls of /health not
        result["stacks"] = {}
        paths: dict[str, bench.Path_] = {}
        for backend, stack in zip(args.backends, stacks, strict=True):
            left = max(30.0, min(args.engine_timeout, began + args.budget_s - time.monotonic()))
            outcome = stack.watch(left)
            record: dict[str, Any] = {"startup": outcome, "startup_s": stack.record["startup_s"]}
            result["stacks"][backend] = record
            if outcome != "ready":
                log = (stack.work / "vllm.log").read_text(errors="replace").splitlines()
                record["vllm_log_tail"] = [line[-300:] for line in log[-30:]]
                problems.append(f"{backend}: the stack did not turn ready ({outcome})")
                continue
            record["ranks"] = ranks_of(stack.admin_url)
            ran = {b for r in record["ranks"].values() for b in r["attention_backends"] or ()}
            if backend not in ran:
                problems.append(f"{backend}: its ranks ran {sorted(ran)}")
                continue
            paths[backend] = bench.Path_(backend, stack.vllm_url)
        if REFERENCE not in paths:
            raise RuntimeError(f"the reference backend {REFERENCE} did not serve")
        model = stacks[0].model_name
        request_bodies, warmup = bodies(args.prompt_words, args.max_tokens)
        highest = max(args.level_list)
        clients = bench.Clients(max(1, math.ceil(highest / bench.STREAMS_PER_CLIENT)), work)
        measured = EngineBench(paths, model, request_bodies, clients,
                               began + args.budget_s - 15.0, warmup, 0)  # fmt: skip
        for path in paths.values():  # untimed: each engine's first batches at every size
            for level in args.level_list:
                measured.one_path(path, level, level, 0)
        measured.run(bench.Plan(args.level_list, rounds, requests, base_rounds=2))
        result["series"] = {str(k): v for k, v in measured.series.items()}
        result["summary"] = {str(k): summarize(v) for k, v in measured.series.items()}
        result["skipped"] = measured.skipped
        for level, entries in measured.series.items():
            for number, entry in enumerate(entries, 1):
                for name, r in entry["paths"].items():
                    if r["completed"] != r["requests"]:
                        problems.append(f"c={level} round {number} {name}: {r['completed']} "
                                        f"of {r['requests']} answered {r['errors']}")  # fmt: skip
        result["what"] = (
            f"live vLLM {stacks[0].release} ({args.spec}, tiny GLM-5.3-Flash, CUDA graphs on) "
            f"on this machine's GPU, direct; {args.max_tokens} output tokens after a prompt of "
            f"about {args.prompt_words} words; --max-num-seqs={highest}"
        )
        result["config"] = {"levels": args.level_list, "rounds_at_most": rounds,
                            "requests_per_backend_per_round": requests,
                            "max_tokens": args.max_tokens, "prompt_words": args.prompt_words,
                            "reference": REFERENCE}  # fmt: skip
    except Exception as error:
        problems.append(f"the run broke off: {type(error).__name__}: {error}")
        if not isinstance(error, (RuntimeError, ValueError, OSError)):
            result["traceback"] = traceback.format_exc()
        if measured is not None and measured.series:
            with contextlib.suppress(Exception):
                result["series"] = {str(k): v for k, v in measured.series.items()}
                result["summary"] = {str(k): summarize(v) for k, v in measured.series.items()}
    finally:
        if clients is not None:
            clients.stop()
        for stack in stacks:
            stack.stop()
        result["problems"] = problems
        result["elapsed_s"] = round(time.monotonic() - began, 1)
        (results / "backends.json").write_text(json.dumps(result, indent=1) + "\n")
        for stack in stacks:
            for log in ("vllm.log", "sidecar.log", "stack.json"):
                if (stack.work / log).is_file():
                    (results / stack.work.name).mkdir(exist_ok=True)
                    shutil.copy2(stack.work / log, results / stack.work.name / log)
    text = table(result)
    (results / "backends.md").write_text(text)
    print(text)
    print(f"results: {results} ({result['elapsed_s']} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
