"""Item 6: the background manifest verifier fails closed and survives its own faults.

In-process (the `serve_sidecar` fixture, a real socket) so a probe can be made to raise,
as one does on drifted code it does not expect.
"""

from __future__ import annotations

import time

import httpx

from mla_serve.patching import probes
from mla_serve.sidecar.settings import Settings
from tests import trees
from tests.scrape import samples


def _wait(url: str, predicate, timeout: float = 15) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{url}/readyz", timeout=5)
        if predicate(response) or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def test_a_raising_probe_fails_closed_and_the_verifier_keeps_running(
    vllm, serve_sidecar, tmp_path, monkeypatch, attack
):
    check = attack("a probe raising inside the background verifier", "6")
    path = tmp_path / "manifest.json"
    target = trees.patched("0.29.0", tmp_path / "tree", path)
    url = serve_sidecar(Settings(vllm_url=vllm.url, manifest=path, vllm_tree=target,
                                 poll_interval=0.05, manifest_interval=0.2))  # fmt: skip
    check.check(_wait(url, lambda r: r.status_code == 200).status_code == 200, "never ready")

    fix_id = next(iter(probes.PROBES))

    def raising(_tree: object) -> object:
        raise RuntimeError("probe blew up on code it did not expect")

    monkeypatch.setitem(probes.PROBES, fix_id, raising)
    failing = _wait(url, lambda r: r.status_code == 503)
    verdict = failing.json()["checks"]["fix_manifest"]
    # The reason reaches /readyz: the error itself, or (the patch engine reports a raising
    # probe as a failing one, naming the error) the drift line that names it.
    detail = " ".join([verdict["detail"], *map(str, verdict.get("drift") or [])])
    check.figures["readyz_detail"] = detail
    check.check(failing.status_code == 503, "still ready with a raising probe")
    check.check("RuntimeError" in detail, f"reason: {detail}")
    check.check(samples(url)["mla_serve_manifest_verified"] == [({}, 0.0)], "metric not 0")

    monkeypatch.undo()  # the verifier is still alive: it turns ready again
    check.check(_wait(url, lambda r: r.status_code == 200).status_code == 200, "verifier died")
    check.done()
