"""Postcondition checks: is a fix's behaviour present in a vLLM tree?

A patch tool's exit code only says that text was replaced. A probe reads the
code of the tree (by its syntax tree, without importing vLLM, so it runs on any
tree and needs no torch or GPU) and checks the property the fix is about: the
guard around the event wait, the capacity row stride, the rejected backend
combination. Each probe accepts any implementation with that property: ours on
affected releases and upstream's own on releases that carry the fix. Where the
affected code does not exist, the probe checks that absence, so a backport of
the buggy code would fail it.

Where the property is arithmetic (the workspace size), the probe runs the
tree's own function on the figures reported in vllm#50781.

Each fix's probe is the module named after it (`dcp-workspace-sizing`: dcp_workspace_sizing.py),
one function registered with `@probe("<fix id>")`; every module of this package is imported
here, so a new probe is found by its file. `syntax.py` holds the shared syntax-tree helpers.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from mla_serve.patching.catalog import ReleaseStatus, Status
from mla_serve.patching.tree import TreeError, VllmTree


@dataclass(frozen=True)
class ProbeResult:
    passed: bool
    detail: str
    # The buggy code is there, but only where vLLM's own code paths are expected not to
    # reach it. Not a pass: it proves `not-affected` only with the catalog's verdict for the
    # release (`not_affected` in [fix.releases], e.g. after a GPU run), never on its own.
    unreachable: bool = False

    @property
    def word(self) -> str:
        if self.passed:
            return "pass"
        return "unreachable" if self.unreachable else "fail"


def proves(claim: ReleaseStatus, result: ProbeResult) -> bool:
    """Whether a probe's result on a tree (its series applied) bears out the catalog's claim:
    the fix is there (patched, upstream), the bug is absent or, with a verdict, unreachable
    (not-affected), or the bug is there (affected: no backport)."""
    if claim.status is Status.AFFECTED:
        return not result.passed
    if claim.status is Status.NOT_AFFECTED and claim.verdict:
        return result.passed or result.unreachable
    return result.passed


Probe = Callable[[VllmTree], ProbeResult]
PROBES: dict[str, Probe] = {}


def probe(fix_id: str) -> Callable[[Probe], Probe]:
    def register(function: Probe) -> Probe:
        PROBES[fix_id] = function
        return function

    return register


def run(fix_id: str, tree: VllmTree) -> ProbeResult:
    try:
        return PROBES[fix_id](tree)
    except SyntaxError as error:
        return ProbeResult(False, f"{error.filename or 'a file'} does not parse: {error.msg}")
    except TreeError:
        raise  # the tree itself is unusable (a path outside it, a file that is not UTF-8)
    except Exception as error:  # a probe must fail closed on code it cannot judge
        return ProbeResult(False, f"probe raised {type(error).__name__}: {error}")


def _register_all() -> None:
    """Import every probe module of this package (each registers its probe)."""
    for info in pkgutil.iter_modules(__path__):
        if info.name != "syntax":
            importlib.import_module(f"{__name__}.{info.name}")


_register_all()
