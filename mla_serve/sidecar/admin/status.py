"""`/status`: one JSON document of what the sidecar knows, and an HTML view of it."""

from __future__ import annotations

import html
import json
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
            "fixes": [
                {"id": f["id"], "status": f["status"], "probe": f.get("probe")} for f in fixes.fixes
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


def render_html(doc: dict[str, Any]) -> str:
    """A page for people: each section of the document as a table."""
    sections = []
    ready = doc["ready"]
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{'ok' if c['ok'] else 'FAIL'}</td>"
        f"<td>{html.escape(str(c['detail']))}</td></tr>"
        for name, c in ready["checks"].items()
    )
    sections.append(f"<h2>Readiness: {html.escape(ready['status'])}</h2><table>{rows}</table>")
    fix_rows = "".join(
        f"<tr><td>{html.escape(f['id'])}</td><td>{html.escape(str(f['status']))}</td>"
        f"<td>{html.escape(str(f['probe']))}</td></tr>"
        for f in doc["fixes"]["fixes"]
    )
    sections.append(
        f"<h2>Fixes (manifest verified: {html.escape(str(doc['fixes']['verified']))})</h2>"
        f"<table><tr><th>fix</th><th>status</th><th>probe</th></tr>{fix_rows}</table>"
    )
    for rank in doc["engine"]["ranks"]:
        figure_rows = "".join(
            f"<tr><td>{html.escape(name)}</td><td>{html.escape(json.dumps(f['value']))}</td>"
            f"<td>{html.escape(str(f['source']))}</td></tr>"
            for name, f in rank["figures"].items()
        )
        sections.append(f"<h2>Engine rank {rank['rank']}</h2><table>{figure_rows}</table>")
    refused = "".join(
        f"<tr><td>{html.escape(r['file'])}</td><td>{html.escape(r['reason'])}</td></tr>"
        for r in doc["engine"]["refused_rank_files"]
    )
    if refused:
        sections.append(f"<h2>Rank files refused</h2><table>{refused}</table>")
    raw = html.escape(json.dumps(doc, indent=2))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>mla-serve status</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;"
        "border-bottom:1px solid #ddd;text-align:left}</style></head><body>"
        f"<h1>mla-serve sidecar · vLLM {html.escape(str(doc['vllm']['version']))}</h1>"
        + "".join(sections)
        + f"<h2>JSON</h2><pre>{raw}</pre></body></html>"
    )
