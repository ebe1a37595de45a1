"""`/status`: one JSON document of what the sidecar knows, and a page of it for people.

`document` is the JSON (`Accept: application/json`, or anything but HTML); `render_html` lays
the same document out as tables: readiness, vLLM, the fixes and whether the manifest verified,
each engine rank's figures side by side, recent runaways, the runaway guard, the canary. The page
reads only the document, so both always say the same.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence
from typing import Any

from mla_serve.engine import contract
from mla_serve.engine.ranks import Rank
from mla_serve.sidecar.admin.health import Verdict
from mla_serve.sidecar.admin.metrics import View


def document(view: View, verdict: Verdict, vllm_url: str, extra: dict[str, Any]) -> dict[str, Any]:
    vllm = view.vllm
    fixes = view.fixes
    return {
        "ready": verdict.body(),
        "vllm": {
            "url": vllm_url,
            "up": vllm.up,
            "health_status": vllm.health_status,
            "version": vllm.version,
            "models": list(vllm.models),
            "error": vllm.error,
            "checked_at": vllm.checked_at,
        },
        "fixes": {
            "manifest": None if fixes.path is None else str(fixes.path),
            "verified": fixes.verified,
            "error": fixes.error,
            "drift": list(fixes.drift),
            "vllm_version": fixes.vllm_version,
            "series_digest": fixes.document.get("series", {}).get("digest"),
            "checked_at": fixes.checked_at,
            "fixes": [
                {
                    "id": f["id"],
                    "title": f.get("title"),
                    "status": f["status"],
                    "probe": f.get("probe"),
                }
                for f in fixes.fixes
            ],
        },
        "engine": {
            "ranks": [_rank(rank) for rank in view.engine.ranks],
            "refused_rank_files": [
                {"file": refused.file, "reason": refused.reason} for refused in view.engine.refused
            ],
        },
        **extra,
    }


def _rank(rank: Rank) -> dict[str, Any]:
    figures = {
        figure.name: {
            "value": contract.jsonable(rank.value(figure.name)),
            "source": rank.source(figure.name),
        }
        for figure in contract.FIGURES
    }
    return {"rank": rank.rank, "figures": figures}


# ---- the page ---------------------------------------------------------------------------------

UNKNOWN = "—"  # a figure no source gave (yet)
GiB = 1 << 30
MiB = 1 << 20

# Each engine figure's row heading on the page, in contract.FIGURES order.
FIGURE_LABELS: dict[str, str] = {
    "cudagraph_mode": "CUDA graph mode",
    "cudagraph_capture_sizes": "Capture sizes",
    "capture_seconds": "Capture time",
    "capture_bytes": "Capture memory",
    "attention_backends": "Attention backends",
    "sparse_mla_workspace_bytes": "Sparse-MLA workspace (allocated)",
    "attention_workspace_bytes": "Attention workspace",
    "parallel": "Parallel layout",
    "phase": "Phase",
    "manifest": "Files against the manifest",
    "sparse_mla_workspace_bytes_predicted": "Sparse-MLA workspace (needed)",
}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #1b1f24; max-width: 80em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #d0d7de; }
p.lead { margin-top: 0; color: #57606a; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { padding: 4px 12px; border-bottom: 1px solid #e5e8eb; text-align: left;
         vertical-align: top; }
th { background: #f6f8fa; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.ok { color: #1a7f37; font-weight: 600; }
.bad { color: #cf222e; font-weight: 600; }
.muted, .source { color: #6e7781; font-size: 0.85em; }
.source { display: block; }
code { font-size: 0.9em; }
"""


def render_html(doc: dict[str, Any]) -> str:
    """A page for people: every section of the document as a table, values in words and
    units (GiB, seconds, "verified"), never raw JSON."""
    now = time.time()
    ready = doc["ready"]
    vllm = doc["vllm"]
    verdict = _word(ready["status"] == "ok", "ready", "not ready")
    title = f"vLLM {_text(vllm['version'] or 'version unknown')}"
    sections = [
        f"<h1>mla-serve sidecar: {verdict}</h1>",
        f"<p class='lead'>{title} at <code>{_text(vllm['url'])}</code>, serving "
        f"{_text(', '.join(vllm['models']) or 'no model yet')}</p>",
        _readiness(ready),
        _vllm(vllm, now),
        _fixes(doc["fixes"], now),
        _engine(doc["engine"]),
    ]
    if "runaways" in doc:
        sections.append(_runaways(doc["runaways"], now))
    if "guard" in doc:
        sections.append(_guard(doc["guard"]))
    if "canary" in doc:
        sections.append(_canary(doc["canary"], now))
    if "pass_through" in doc:
        sections.append(_pass_through(doc["pass_through"], doc.get("vllm_log")))
    errors = doc.get("background_errors") or {}
    if errors:
        sections.append(
            "<h2>Background tasks that failed</h2>"
            + _table(("task", "last error"), ((_text(k), _text(v)) for k, v in errors.items()))
        )
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>mla-serve status</title><style>{STYLE}</style></head><body>"
        + "".join(sections)
        + "<p class='muted'>The same document as JSON: <code>curl -H 'Accept: application/json'"
        " …/status</code>.</p></body></html>"
    )


def _readiness(ready: dict[str, Any]) -> str:
    rows = (
        (_text(name), _word(check["ok"], "passes", "fails"), _text(check["detail"]))
        for name, check in ready["checks"].items()
    )
    return "<h2>Readiness (/readyz)</h2>" + _table(("check", "result", "detail"), rows)


def _vllm(vllm: dict[str, Any], now: float) -> str:
    if vllm["up"]:
        health = _word(True, "up (/health 200)", "")
    else:
        why = vllm["error"] or f"/health {vllm['health_status']}"
        health = _word(False, "", f"down: {why}")
    rows = [
        ("URL", f"<code>{_text(vllm['url'])}</code>"),
        ("health", health),
        ("version", _text(vllm["version"] or UNKNOWN)),
        ("models", _text(", ".join(vllm["models"]) or "none listed")),
        ("last checked", _when(vllm["checked_at"], now)),
    ]
    return "<h2>vLLM</h2>" + _table(("", ""), rows, header=False)


def _fixes(fixes: dict[str, Any], now: float) -> str:
    if fixes["manifest"] is None:
        state = "<span class='muted'>no manifest given (--manifest)</span>"
    elif fixes["verified"] is True:
        state = _word(True, "verified", "")
    elif fixes["verified"] is False:
        state = _word(False, "", "not verified")
        if fixes["error"]:
            state += f": {_text(fixes['error'])}"
    else:
        state = "<span class='muted'>not checked yet</span>"
    rows = [
        ("manifest", state),
        ("file", _text(fixes["manifest"] or UNKNOWN)),
        ("vLLM release", _text(fixes["vllm_version"] or UNKNOWN)),
        ("fix series", f"<code>{_text(fixes['series_digest'] or UNKNOWN)}</code>"),
        ("last checked", _when(fixes.get("checked_at"), now)),
    ]
    if fixes["drift"]:
        rows.append(("files changed since", _text(", ".join(fixes["drift"]))))
    out = "<h2>Fixes</h2>" + _table(("", ""), rows, header=False)
    if fixes["fixes"]:
        out += _table(
            ("fix", "what it fixes", "status", "probe"),
            (
                (
                    f"<code>{_text(f['id'])}</code>",
                    _text(f.get("title") or ""),
                    _text(f["status"]),
                    _probe(f["probe"]),
                )
                for f in fixes["fixes"]
            ),
        )
    return out


def _probe(word: str | None) -> str:
    if word == "pass":
        return _word(True, "passes", "")
    if word is None:
        return _text(UNKNOWN)
    return _word(False, "", _text(word))


def _engine(engine: dict[str, Any]) -> str:
    ranks = engine["ranks"]
    out = "<h2>Engine ranks</h2>"
    if not ranks:
        out += (
            "<p class='muted'>No rank has reported yet (the engine plugin writes each rank's "
            "figures after CUDA graph capture; --vllm-log reads them from vLLM's log).</p>"
        )
    else:
        headers = ("", *(f"rank {rank['rank']}" for rank in ranks))
        rows = []
        for figure in contract.FIGURES:
            cells = [_figure(figure.name, rank["figures"][figure.name]) for rank in ranks]
            rows.append((_text(FIGURE_LABELS.get(figure.name, figure.name)), *cells))
        out += _table(headers, rows, first_is_header=True)
    if engine["refused_rank_files"]:
        out += "<h2>Rank files refused</h2>" + _table(
            ("file", "reason"),
            ((_text(r["file"]), _text(r["reason"])) for r in engine["refused_rank_files"]),
        )
    return out


def _figure(name: str, figure: dict[str, Any]) -> str:
    value, source = figure["value"], figure["source"]
    if value is None:
        return f"<span class='muted'>{UNKNOWN}</span>"
    shown = _text(_figure_text(name, value))
    return shown + (f"<span class='source'>{_text(source)}</span>" if source else "")


def _figure_text(name: str, value: Any) -> str:
    if name.endswith("_bytes") or name == "sparse_mla_workspace_bytes_predicted":
        return _bytes(int(value))
    if name == "capture_seconds":
        return f"{float(value):.1f} s"
    if name == "cudagraph_capture_sizes":
        sizes = [int(v) for v in value]
        if not sizes:
            return "none"
        listed = ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{sizes[0]} … {sizes[-1]}"
        return f"{len(sizes)} ({listed})"
    if name == "attention_backends":
        return ", ".join(value) or "none"
    if name == "parallel":
        parts = [f"{key.upper()}{value[key]}" for key in ("tp", "pp", "dp", "pcp", "dcp")]
        return " x ".join(parts) + (", EP" if value.get("ep") else "")
    if name == "manifest":
        if value.get("files_match") is True:
            return "match"
        if value.get("files_match") is False:
            return "differ: " + ", ".join(value.get("mismatched") or ())
        return "could not be read"
    return str(value)


def _runaways(runaways: dict[str, Any], now: float) -> str:
    out = "<h2>Length-cap runaways</h2>"
    counts = runaways.get("by_model") or []
    if counts:
        out += _table(
            ("model", "completions", "runaways", "tokens they burnt"),
            (
                (
                    _text(c["model"]),
                    _num(c["completions"]),
                    _num(c["runaways"]),
                    _num(c["runaway_tokens"]),
                )
                for c in counts
            ),
            numeric=(1, 2, 3),
        )
    recent = runaways.get("recent") or []
    if not recent:
        return out + "<p class='muted'>No runaway since the sidecar started.</p>"
    return out + _table(
        ("when", "request", "model", "cause", "prompt tokens", "completion tokens", "reasoning"),
        (
            (
                _when(r["at"], now),
                f"<code>{_text(r['request_id'] or UNKNOWN)}</code>",
                _text(r["model"]),
                _text(r["cause"].replace("_", " ")),
                _num(r["prompt_tokens"]),
                _num(r["completion_tokens"]),
                _num(r["reasoning_tokens"]),
            )
            for r in recent
        ),
        numeric=(4, 5, 6),
    )


def _guard(guard: dict[str, Any]) -> str:
    per_model = guard.get("model_actions") or {}
    repetition = guard.get("repetition_detection")
    budget = guard.get("thinking_token_budget")
    rows = [
        ("action", _text(guard["action"])),
        (
            "per model",
            _text(", ".join(f"{m}: {a}" for m, a in per_model.items()) or "none"),
        ),
        (
            "a loop is",
            _text(
                f"a unit repeated at least {guard['min_repeats']} times over at least "
                f"{guard['min_chars']} characters (units up to "
                f"{guard['window_chars'] // guard['min_repeats']} characters)"
            ),
        ),
        (
            "vLLM's repetition_detection on requests without one",
            _text(
                "off"
                if repetition is None
                else ", ".join(f"{k} {v}" for k, v in repetition.items())
            ),
        ),
        (
            "vLLM's thinking_token_budget on requests without one",
            _text("off" if budget is None else f"{budget} tokens"),
        ),
    ]
    out = "<h2>Runaway guard</h2>" + _table(("", ""), rows, header=False)
    seen = guard.get("by_model") or []
    if seen:
        out += _table(
            ("model", "loops in reasoning", "loops in content", "streams stopped", "tokens saved"),
            (
                (
                    _text(g["model"]),
                    _num(g["loops"].get("reasoning", 0)),
                    _num(g["loops"].get("content", 0)),
                    _num(g["stops"]),
                    _num(g["tokens_saved"]),
                )
                for g in seen
            ),
            numeric=(1, 2, 3, 4),
        )
    else:
        out += "<p class='muted'>No loop confirmed since the sidecar started.</p>"
    return out


def _canary(canary: dict[str, Any], now: float) -> str:
    if not canary.get("enabled"):
        return "<h2>Canary</h2><p class='muted'>Off (--canary-prompt-file).</p>"
    last = canary.get("last_round")
    rows: list[tuple[str, str]] = []
    if isinstance(last, dict):
        rows = [(_text(str(k).replace("_", " ")), _text(_plain(v))) for k, v in last.items()]
    rows.append(("recent runaways", _num(len(canary.get("recent_runaways") or []))))
    return "<h2>Canary</h2>" + _table(("", ""), rows, header=False)


def _pass_through(passthrough: dict[str, Any], vllm_log: dict[str, Any] | None) -> str:
    lane = "on (token chunks read in C)" if passthrough.get("lane") else "off (reads in Python)"
    rows = [("C lane", _text(lane)), ("reads in C", _num(passthrough.get("lane_reads", 0)))]
    if vllm_log is not None:
        state = vllm_log["error"] or "followed"
        rows.append(("vLLM log", _text(f"{vllm_log['path']}: {state}")))
    return "<h2>Pass-through</h2>" + _table(("", ""), rows, header=False)


# ---- cells ----------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return html.escape(str(value))


def _plain(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ", ".join(_plain(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_plain(v)}" for k, v in value.items())
    return str(value)


def _word(good: bool, yes: str, no: str) -> str:
    if good:
        return f"<span class='ok'>{_text(yes)}</span>"
    return f"<span class='bad'>{_text(no)}</span>"


def _num(value: Any) -> str:
    if value is None:
        return f"<span class='muted'>{UNKNOWN}</span>"
    return f"{int(value):,}" if float(value).is_integer() else f"{float(value):,.2f}"


def _bytes(value: int) -> str:
    if abs(value) >= GiB:
        return f"{value / GiB:.2f} GiB"
    if abs(value) >= MiB:
        return f"{value / MiB:.1f} MiB"
    return f"{value:,} B"


def _when(at: float | None, now: float) -> str:
    if at is None:
        return f"<span class='muted'>{UNKNOWN}</span>"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    ago = max(0.0, now - at)
    if ago < 120:
        age = f"{ago:.0f} s ago"
    elif ago < 7200:
        age = f"{ago / 60:.0f} min ago"
    else:
        age = f"{ago / 3600:.1f} h ago"
    return f"{stamp} <span class='muted'>({age})</span>"


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    header: bool = True,
    first_is_header: bool = False,
    numeric: Sequence[int] = (),
) -> str:
    """Cells are HTML already (escaped where they hold data); headers are plain text."""
    head = "<tr>" + "".join(f"<th>{_text(h)}</th>" for h in headers) + "</tr>" if header else ""
    body = []
    for row in rows:
        cells = []
        for index, cell in enumerate(row):
            if index == 0 and (first_is_header or not header):
                cells.append(f"<th scope='row'>{cell}</th>")
            else:
                css = " class='num'" if index in numeric else ""
                cells.append(f"<td{css}>{cell}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table>{head}{''.join(body)}</table>"
