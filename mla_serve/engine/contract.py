"""The contract between the engine plugin, the vLLM log parser and the sidecar.

One engine rank's figures are a `RankRecord`. The plugin builds one per rank from
vLLM's objects and writes it as JSON (`rank-<n>.json`, with `"schema": SCHEMA`);
the log parser builds the same type from vLLM's log lines; the sidecar reads the
files back through `decode`, which trusts nothing: a file is another process's
output, so every field is checked against the type declared here, and a file of
another schema version, a missing field or a wrong type is refused with a reason
(shown in the sidecar's /status), never a crash.

`FIGURES` is the one table of what the sidecar shows per rank: each figure's name
(a `RankRecord` field, or a figure the sidecar derives), in /status order, and the
Prometheus series it feeds (name, help, labels, how a value becomes samples). The
sidecar generates both its /status figures and its /metrics engine series from it.

Adding an engine figure with its metric, four files: a field on `RankRecord`, its name in
`FigureName` and a row in `FIGURES` (this file); the code that fills it in
mla_serve/engine/plugin/collect.py; a test of its series (tests/test_sidecar.py); its row in
the engine-series table of mla_serve/sidecar/README.md (tests/test_contract.py holds the
table to `FIGURES`). Decoding, /status and /metrics follow. Measured on a copy, a per-rank
gauge of vLLM's max_model_len: those four files, ten lines.

The schema version changes only when a field changes meaning or type, or
disappears: a new optional field keeps it (an older reader ignores fields it does
not know; a newer reader sees `None` for a field an older writer did not write).
This module imports only the standard library: it runs inside vLLM's processes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal, Union, get_args, get_origin

SCHEMA: Final = 1

Phase = Literal["captured", "ready"]  # after graph capture; after warm-up (the rank serves)


class ContractError(ValueError):
    """A rank record that does not follow this contract; the message says where and why."""


@dataclass(frozen=True)
class Parallel:
    """The engine's parallel layout, as this rank's vLLM config has it."""

    tp: int
    pp: int
    dp: int
    pcp: int
    dcp: int
    ep: bool


@dataclass(frozen=True)
class ManifestCheck:
    """Do the vLLM files this rank's process imports still match the fix manifest?"""

    path: str
    files_match: bool | None  # None: the manifest or the tree could not be read
    mismatched: tuple[str, ...]


@dataclass(frozen=True)
class RankRecord:
    """What one engine rank really runs. `None`: not known (a release without the
    attribute, a source that does not give it, or not measured yet)."""

    rank: int  # the global rank
    local_rank: int | None = None
    pid: int | None = None
    host: str | None = None
    phase: Phase | None = None
    updated_at: float | None = None  # Unix time of the write
    vllm_version: str | None = None
    model_runner: str | None = None  # the runner's module: V1 or V2 model runner
    cudagraph_mode: str | None = None  # resolved, after any backend downgrade
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    capture_seconds: float | None = None
    capture_bytes: int | None = None  # vLLM's own measure; negative when others freed memory
    attention_backends: tuple[str, ...] | None = None
    sparse_mla_workspace_bytes: int | None = None  # FlashInfer's sparse-MLA workspace (SM100)
    attention_workspace_bytes: int | None = None  # vLLM's shared attention scratch
    num_attention_heads_per_rank: int | None = None
    max_num_batched_tokens: int | None = None
    parallel: Parallel | None = None
    manifest: ManifestCheck | None = None


# The names of the figures /status shows, each a RankRecord field or a DERIVED figure.
FigureName = Literal[
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "capture_seconds",
    "capture_bytes",
    "attention_backends",
    "sparse_mla_workspace_bytes",
    "attention_workspace_bytes",
    "parallel",
    "phase",
    "manifest",
    "sparse_mla_workspace_bytes_predicted",
]
# Figures the sidecar computes from a record, with the source /status names for them.
DERIVED: Final[dict[str, str]] = {"sparse_mla_workspace_bytes_predicted": "sizing model"}

# How a figure's value becomes samples of its series (every engine series is a gauge):
# "value": the number itself; "count": the length of a list; "info": one sample of value 1
# per string (the figure's own, or each of a list's), carried in the series' info label.
Sample = Literal["value", "count", "info"]


@dataclass(frozen=True)
class Series:
    """A Prometheus gauge family fed by one figure of every rank."""

    name: str
    help: str
    sample: Sample
    labels: tuple[str, ...] = ("rank",)  # in exposition order; "rank" is the engine rank
    info_label: str | None = None  # the label that carries an "info" sample's string
    constants: tuple[tuple[str, str], ...] = ()  # labels of fixed value, e.g. kind=actual


@dataclass(frozen=True)
class Figure:
    name: FigureName
    series: Series | None = None


_WORKSPACE = "mla_serve_sparse_mla_workspace_bytes"
_WORKSPACE_HELP = (
    "FlashInfer sparse-MLA workspace per rank: allocated, and the sizing model's figure."
)

FIGURES: Final[tuple[Figure, ...]] = (
    Figure(
        "cudagraph_mode",
        Series(
            "mla_serve_cudagraph_mode_info",
            "CUDA graph mode each engine rank runs, after backend downgrades.",
            "info",
            ("mode", "rank"),
            info_label="mode",
        ),
    ),
    Figure(
        "cudagraph_capture_sizes",
        Series(
            "mla_serve_cudagraph_capture_sizes",
            "Number of batch sizes captured as CUDA graphs.",
            "count",
        ),
    ),
    Figure(
        "capture_seconds",
        Series(
            "mla_serve_cudagraph_capture_duration_seconds",
            "Wall time of CUDA graph capture.",
            "value",
        ),
    ),
    Figure(
        "capture_bytes",
        Series(
            "mla_serve_cudagraph_capture_memory_bytes",
            "GPU memory taken by CUDA graph capture.",
            "value",
        ),
    ),
    Figure(
        "attention_backends",
        Series(
            "mla_serve_attention_backend_info",
            "Attention backends each engine rank selected.",
            "info",
            ("backend", "rank"),
            info_label="backend",
        ),
    ),
    Figure(
        "sparse_mla_workspace_bytes",
        Series(_WORKSPACE, _WORKSPACE_HELP, "value", ("rank", "kind"), None, (("kind", "actual"),)),
    ),
    Figure(
        "attention_workspace_bytes",
        Series(
            "mla_serve_attention_workspace_bytes",
            "vLLM's shared attention workspace per rank, at its size locked after graph capture.",
            "value",
        ),
    ),
    Figure("parallel"),
    Figure("phase"),
    Figure("manifest"),
    Figure(
        "sparse_mla_workspace_bytes_predicted",
        Series(
            _WORKSPACE, _WORKSPACE_HELP, "value", ("rank", "kind"), None, (("kind", "predicted"),)
        ),
    ),
)


def encode(record: RankRecord) -> dict[str, Any]:
    """The record as the JSON object of a rank file, schema version included. Checked
    against the contract first: a writer never writes what a reader would refuse."""
    document = {"schema": SCHEMA, **jsonable(record)}
    decode(document)
    return document


def decode(document: object) -> RankRecord:
    """A rank file's JSON object as a record; `ContractError` when it breaks the contract."""
    if not isinstance(document, dict):
        raise ContractError(f"expected a JSON object, got {_kind(document)}")
    if "schema" not in document:
        raise ContractError("no schema version")
    schema = document["schema"]
    if schema != SCHEMA or isinstance(schema, bool):
        raise ContractError(
            f"schema {_shown(schema)}: this sidecar reads schema {SCHEMA} "
            "(the engine's mla-serve and the sidecar's differ: run the same release in both)"
        )
    record = _decoder(RankRecord)(document, "")
    assert isinstance(record, RankRecord)
    if record.rank < 0:
        raise ContractError(f"rank: {record.rank} is negative")
    return record


def jsonable(value: object) -> Any:
    """A record, or one of its figures, as plain JSON values (tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [jsonable(item) for item in value]
    return value


Decoder = Callable[[object, str], object]  # (JSON value, where it is) -> the typed value


@functools.cache
def _decoder(kind: Any) -> Decoder:
    """A checking converter for one declared type, built once (a scrape decodes every file)."""
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        (inner,) = [arg for arg in args if arg is not type(None)]  # only `X | None` is used
        present = _decoder(inner)
        return lambda value, where: None if value is None else present(value, where)
    if origin is Literal:
        return functools.partial(_literal, args)
    if origin is tuple:
        return functools.partial(_tuple, _decoder(args[0]))
    if dataclasses.is_dataclass(kind):
        assert isinstance(kind, type)
        hints = typing.get_type_hints(kind)
        fields = tuple(
            (f.name, _decoder(hints[f.name]), f.default is dataclasses.MISSING)
            for f in dataclasses.fields(kind)
        )
        return functools.partial(_object, kind, fields)
    if kind in _SCALARS:
        return _SCALARS[kind]
    raise TypeError(f"the contract declares a type it cannot check: {kind!r}")


def _literal(allowed: tuple[object, ...], value: object, where: str) -> object:
    if not any(value == arg and type(value) is type(arg) for arg in allowed):
        raise ContractError(f"{where}: expected one of {list(allowed)}, got {_shown(value)}")
    return value


def _tuple(item: Decoder, value: object, where: str) -> tuple[object, ...]:
    if not isinstance(value, list):
        raise ContractError(f"{where}: expected a list, got {_kind(value)}")
    return tuple(item(element, f"{where}[{i}]") for i, element in enumerate(value))


def _object(
    kind: type, fields: tuple[tuple[str, Decoder, bool], ...], value: object, where: str
) -> object:
    if not isinstance(value, dict):
        raise ContractError(f"{where}: expected an object, got {_kind(value)}")
    found = {}
    for name, decoder, required in fields:
        if name in value:
            found[name] = decoder(value[name], f"{where}.{name}" if where else name)
        elif required:
            raise ContractError(f"{where}.{name}: missing" if where else f"{name}: missing")
    return kind(**found)


def _bool(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    raise ContractError(f"{where}: expected true or false, got {_kind(value)}")


def _int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ContractError(f"{where}: expected an integer, got {_kind(value)}")
    if not -(1 << 63) <= value < 1 << 63:
        raise ContractError(f"{where}: an integer of {value.bit_length()} bits, over 64")
    return value


def _float(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ContractError(f"{where}: expected a number, got {_kind(value)}")
    if not math.isfinite(value):
        raise ContractError(f"{where}: expected a finite number, got {_shown(value)}")
    return float(value)


def _str(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    raise ContractError(f"{where}: expected a string, got {_kind(value)}")


_SCALARS: dict[Any, Decoder] = {bool: _bool, int: _int, float: _float, str: _str}


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {_shown(value)}"


def _shown(value: object) -> str:
    """A value as a reason quotes it: short, whatever a file holds."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_table() -> None:
    """The table agrees with the record: every figure is a field or derived, once; every
    series' rule fits its field's type; the rows of one family agree. Raises ValueError."""
    hints = typing.get_type_hints(RankRecord)
    names = [figure.name for figure in FIGURES]
    declared = set(get_args(FigureName))
    if len(set(names)) != len(names) or set(names) != declared:
        raise ValueError(f"FIGURES and FigureName differ: {sorted(set(names) ^ declared)}")
    families: dict[str, Series] = {}
    for figure in FIGURES:
        if figure.name not in hints and figure.name not in DERIVED:
            raise ValueError(f"{figure.name}: neither a RankRecord field nor derived")
        series = figure.series
        if series is None:
            continue
        kind = hints.get(figure.name, int | None)  # derived figures are numbers
        _check_series(figure.name, series, kind)
        first = families.setdefault(series.name, series)
        if (first.help, first.labels, first.sample) != (series.help, series.labels, series.sample):
            raise ValueError(f"{series.name}: its rows disagree on help, labels or sample")


def _check_series(name: str, series: Series, kind: Any) -> None:
    inner = [arg for arg in get_args(kind) if arg is not type(None)] or [kind]
    (base,) = inner
    element = get_args(base)[0] if get_origin(base) is tuple else None
    fits = {
        "value": base in (int, float),
        "count": element is not None,
        "info": base is str or get_origin(base) is Literal or element is str,
    }[series.sample]
    if not fits:
        raise ValueError(f"{name}: a {series.sample!r} series cannot take a {kind}")
    own = {"rank", *(label for label, _ in series.constants)}
    if series.info_label is not None:
        own.add(series.info_label)
    if (series.sample == "info") != (series.info_label is not None) or set(series.labels) != own:
        raise ValueError(f"{name}: {series.name}'s labels {series.labels} do not fit its rule")
