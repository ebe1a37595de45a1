"""Run a callback when a module is imported, without importing it ahead of time.

vLLM loads general plugins early in every process, before its worker modules are
imported, and some processes (the API server) never import them. Patching on
import keeps the plugin from pulling heavy GPU modules into processes that do
not use them, and from depending on vLLM's import order.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]
_pending: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` now if `name` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        _call(callback, module)
        return
    _pending.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _call(callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # a reporting hook must never break vLLM's import
        logger.exception("mla-serve: hook on %s failed; vLLM continues without it", module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the module's pending callbacks."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in _pending.pop(self._name, []):
            _call(callback, module)
