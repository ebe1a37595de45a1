"""Bytes per weight matrix, from a checkpoint's `quantization_config` or an override.

Formats (bytes for an N x K matrix, as the checkpoint stores them and vLLM keeps them):

- bf16: 2 B per parameter.
- fp8 with `weight_block_size` [bn, bk]: 1 B per parameter + one fp32 scale per bn x bk
  block (DeepSeek-V3.2, GLM-5.x FP8); fp8 without blocks: 1 B + a per-tensor fp32 scale.
- nvfp4: 0.5 B per parameter + one E4M3 scale per 16 + fp32 global and input scales.
- mxfp4: 0.5 B per parameter + one E8M0 scale per 32.
- int4 (compressed-tensors w4a16, group g): 0.5 B + a bf16 scale per g (+ a packed zero
  point per g when asymmetric).

Which linear layers a checkpoint quantizes comes from its config's ignore lists
(`ignore`, `exclude_modules`, `modules_to_not_convert`, `ignored_layers`), matched
against the Hugging Face module names: `re:` patterns as regular expressions, `*` as
globs, plain names as exact names or module prefixes.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from mla_serve.sizing.shape import SizingError


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightFormat:
    kind: str  # bf16 | fp8 | nvfp4 | mxfp4 | int4
    block: tuple[int, int] | None = None  # fp8 block [n, k]
    group: int = 0  # int4 group size
    symmetric: bool = True

    @property
    def label(self) -> str:
        if self.kind == "fp8" and self.block:
            return f"fp8 (block {self.block[0]}x{self.block[1]})"
        if self.kind == "int4":
            return f"int4 (group {self.group})"
        return self.kind

    def matrix_bytes(self, n: int, k: int) -> int:
        """Bytes of one N x K weight (a rank's shard: pass the local shape)."""
        params = n * k
        if self.kind == "bf16":
            return 2 * params
        if self.kind == "fp8":
            if self.block:
                return params + 4 * _ceil(n, self.block[0]) * _ceil(k, self.block[1])
            return params + 8  # weight_scale + input_scale
        if self.kind == "nvfp4":
            return _ceil(params, 2) + _ceil(params, 16) + 8
        if self.kind == "mxfp4":
            return _ceil(params, 2) + _ceil(params, 32)
        if self.kind == "int4":
            groups = n * _ceil(k, self.group)
            zeros = 0 if self.symmetric else _ceil(groups, 2)
            return _ceil(params, 2) + 2 * groups + zeros
        raise AssertionError(self.kind)


BF16 = WeightFormat("bf16")
OVERRIDES = {
    "bf16": BF16,
    "fp8": WeightFormat("fp8", block=(128, 128)),
    "nvfp4": WeightFormat("nvfp4"),
    "mxfp4": WeightFormat("mxfp4"),
}
"""`--weight-dtype` / `--expert-dtype` choices (fp8 as DeepSeek's 128x128 blocks)."""

ROUTED_EXPERT = "routed_expert"


@dataclass(frozen=True)
class Scheme:
    """Which format a quantizable linear layer gets, from the checkpoint or an override."""

    default: WeightFormat
    ignore: tuple[str, ...] = ()
    expert: WeightFormat | None = None  # routed experts, when they differ
    targets: tuple[tuple[str, WeightFormat], ...] = ()  # compressed-tensors regex targets
    description: str = "bf16 (no quantization_config)"

    def format_for(self, kind: str, names: Iterable[str]) -> WeightFormat:
        """The format of a linear layer of `kind`, known by its candidate module names."""
        names = tuple(names)
        if any(_matches(name, pattern) for name in names for pattern in self.ignore):
            return BF16
        for pattern, fmt in self.targets:
            if any(_matches(name, pattern) for name in names):
                return fmt
        if kind == ROUTED_EXPERT and self.expert is not None:
            return self.expert
        return self.default


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")


def _patterns(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SizingError(f"quantization_config ignore list must be a list of names, got {value!r}")


def _fp8(quant: dict[str, Any]) -> WeightFormat:
    block = quant.get("weight_block_size")
    if block is None:
        return WeightFormat("fp8")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise SizingError(f"quantization_config weight_block_size must be [n, k], got {block!r}")
    return WeightFormat("fp8", block=(block[0], block[1]))


def _ct_format(weights: dict[str, Any]) -> WeightFormat | None:
    bits, kind = weights.get("num_bits"), weights.get("type")
    group = weights.get("group_size")
    if bits == 4 and kind == "float":
        return WeightFormat("nvfp4") if group in (16, None) else WeightFormat("mxfp4")
    if bits == 8 and kind == "float":
        block = weights.get("block_structure")
        if isinstance(block, list) and len(block) == 2:
            return WeightFormat("fp8", block=(int(block[0]), int(block[1])))
        return WeightFormat("fp8")
    if bits == 4 and kind == "int" and isinstance(group, int) and group > 0:
        return WeightFormat("int4", group=group, symmetric=bool(weights.get("symmetric", True)))
    if bits == 16:
        return BF16
    return None


def _compressed_tensors(quant: dict[str, Any], warnings: list[str]) -> Scheme:
    default: WeightFormat | None = None
    targets: list[tuple[str, WeightFormat]] = []
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise SizingError("quantization_config config_groups must be an object")
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = _ct_format(weights) if isinstance(weights, dict) else None
        if fmt is None:
            warnings.append(
                f"unrecognised compressed-tensors weight scheme {weights!r}: counted as bf16"
            )
            fmt = BF16
        for target in _patterns(group.get("targets")):
            if target == "Linear":
                default = fmt
            else:
                targets.append((target, fmt))
    ignore = _patterns(quant.get("ignore"))
    return Scheme(
        default=default or BF16,
        ignore=ignore,
        targets=tuple(targets),
        description=f"compressed-tensors ({(default or BF16).label} linears"
        + (f", {len(ignore)} ignore entries)" if ignore else ")"),
    )


def _modelopt(quant: dict[str, Any], warnings: list[str]) -> Scheme:
    inner = quant.get("quantization", quant)
    if not isinstance(inner, dict):
        inner = quant
    algo = str(inner.get("quant_algo") or quant.get("quant_algo") or "").upper()
    ignore = _patterns(inner.get("exclude_modules", quant.get("exclude_modules"))) + _patterns(
        inner.get("ignore", quant.get("ignore"))
    )
    if algo == "NVFP4":
        fmt = WeightFormat("nvfp4")
    elif algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        fmt = WeightFormat("fp8")
    elif algo in ("FP8_BLOCKWISE", "FP8_PB_WO"):
        fmt = WeightFormat("fp8", block=(128, 128))
    else:
        warnings.append(f"modelopt quant_algo {algo or '?'!r} not modelled: counted as bf16")
        fmt = BF16
    return Scheme(
        default=fmt,
        ignore=ignore,
        description=f"modelopt {algo or '?'} ({len(ignore)} exclude entries)",
    )


def scheme(
    quant: dict[str, Any] | None,
    weight_dtype: str | None = None,
    expert_dtype: str | None = None,
    warnings: list[str] | None = None,
) -> Scheme:
    """The checkpoint's scheme, or the `--weight-dtype` / `--expert-dtype` overrides."""
    warnings = warnings if warnings is not None else []
    if weight_dtype is not None:
        base = Scheme(default=OVERRIDES[weight_dtype], description=f"{weight_dtype} (override)")
    else:
        base = _from_config(quant, warnings)
    if expert_dtype is None:
        return base
    return Scheme(
        default=base.default,
        ignore=base.ignore,
        expert=OVERRIDES[expert_dtype],
        targets=base.targets,
        description=f"{base.description}; routed experts {expert_dtype} (override)",
    )


def _from_config(quant: dict[str, Any] | None, warnings: list[str]) -> Scheme:
    if not quant:
        return Scheme(default=BF16)
    method = str(quant.get("quant_method") or "").lower()
    if method == "fp8":
        fmt = _fp8(quant)
        ignore = _patterns(quant.get("modules_to_not_convert")) + _patterns(
            quant.get("ignored_layers")
        )
        expert = WeightFormat("mxfp4") if quant.get("expert_dtype") == "fp4" else None
        return Scheme(
            default=fmt,
            ignore=ignore,
            expert=expert,
            description=f"{fmt.label}" + (f", {len(ignore)} excluded" if ignore else ""),
        )
    if method.startswith("modelopt"):
        return _modelopt(quant, warnings)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, warnings)
    warnings.append(
        f"quantization_config quant_method {method or '?'!r} is not modelled: weights are "
        "counted as bf16 (pass --weight-dtype/--expert-dtype or --weights-gib)"
    )
    return Scheme(default=BF16, description=f"{method or '?'} (not modelled, bf16 assumed)")


def kv_cache_dtype_from_config(quant: dict[str, Any] | None) -> str | None:
    """What vLLM's `--kv-cache-dtype auto` resolves to from a ModelOpt checkpoint.

    Mirrors vllm/utils/torch_utils.py `get_kv_cache_quant_algo_string` (ModelOpt only):
    a static 8-bit float `kv_cache_scheme` means fp8, `kv_cache_quant_algo: FP8` means
    fp8_e4m3 (both 1 B per element). An NVFP4 KV scheme is not modelled (None).
    """
    if not quant or not str(quant.get("quant_method", "")).startswith("modelopt"):
        return None
    inner = quant.get("quantization", quant)
    inner = inner if isinstance(inner, dict) else quant
    algo = (
        inner.get("kv_cache_scheme")
        or quant.get("kv_cache_scheme")
        or inner.get("kv_cache_quant_algo")
        or quant.get("kv_cache_quant_algo")
    )
    if isinstance(algo, dict):
        fp8 = algo.get("num_bits") == 8 and algo.get("type") == "float"
        return "fp8" if fp8 and algo.get("dynamic") is False else None
    if isinstance(algo, str) and algo.lower() == "fp8":
        return "fp8_e4m3"
    return None
