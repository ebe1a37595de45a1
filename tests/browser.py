"""A page as a person sees it: Debian's headless Chromium, driven over the DevTools protocol.

`Browser` starts `chromium --headless` (a throwaway profile, its DevTools port on 127.0.0.1),
opens a URL in a tab and answers with what the page shows: its visible text
(`document.body.innerText`), each table's cells as rendered text, and a PNG screenshot of the
whole page. Every wait is bounded. Without a `chromium` binary the caller skips (or, under CI,
fails): `.ci/run` installs Debian's package.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

BINARIES = ("chromium", "chromium-browser")
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")

# Every table's rows as the reader sees them (innerText per cell), in page order.
TABLES_JS = (
    "[...document.querySelectorAll('table')].map(t => "
    "[...t.rows].map(r => [...r.cells].map(c => c.innerText.trim())))"
)


def binary() -> str | None:
    return next((found for name in BINARIES if (found := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One headless Chromium for a `with` block; `page(url)` renders a page in a new tab."""

    def __init__(self, width: int = 1280, height: int = 900, timeout: float = 60.0) -> None:
        found = binary()
        if found is None:
            raise BrowserError("no chromium binary (Debian's package `chromium`)")
        self._binary = found
        self._size = (width, height)
        self._timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="mla-serve-chromium-")
        self._process: subprocess.Popen[str] | None = None
        self.endpoint = ""

    def __enter__(self) -> Browser:
        width, height = self._size
        self._process = subprocess.Popen(
            [
                self._binary,
                "--headless",
                "--no-sandbox",  # root in a container has no user namespace for the sandbox
                "--disable-gpu",
                "--no-first-run",
                "--hide-scrollbars",
                f"--window-size={width},{height}",
                f"--user-data-dir={self._profile.name}",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + self._timeout
        assert self._process.stderr is not None
        while time.monotonic() < deadline:
            line = self._process.stderr.readline()
            if not line and self._process.poll() is not None:
                raise BrowserError(f"chromium exited with {self._process.returncode}")
            found = LISTENING.search(line)
            if found:
                self.endpoint = found.group(1)
                break
        else:
            raise BrowserError(f"chromium gave no DevTools endpoint in {self._timeout:.0f} s")
        # Keep reading its log so a full pipe never blocks it.
        threading.Thread(target=self._process.stderr.read, daemon=True).start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=15)
        self._profile.cleanup()

    def page(self, url: str, screenshot: Path | None = None) -> Page:
        """Load `url` in a new tab and read what it shows (and save a screenshot)."""
        return asyncio.run(asyncio.wait_for(self._page(url, screenshot), self._timeout))

    async def _page(self, url: str, screenshot: Path | None) -> Page:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(self.endpoint, max_msg_size=64 << 20) as ws,
        ):
            cdp = _Cdp(ws)
            target = await cdp.call("Target.createTarget", url="about:blank")
            attached = await cdp.call(
                "Target.attachToTarget", targetId=target["targetId"], flatten=True
            )
            session_id = attached["sessionId"]
            await cdp.call("Page.enable", session=session_id)
            await cdp.call("Page.navigate", session=session_id, url=url)
            await cdp.event("Page.loadEventFired", session_id)
            text = await cdp.evaluate(session_id, "document.body.innerText")
            title = await cdp.evaluate(session_id, "document.title")
            tables = await cdp.evaluate(session_id, TABLES_JS)
            if screenshot is not None:
                shot = await cdp.call(
                    "Page.captureScreenshot",
                    session=session_id,
                    format="png",
                    captureBeyondViewport=True,
                )
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            await cdp.call("Target.closeTarget", targetId=target["targetId"])
            return Page(title=str(title), text=str(text), tables=tables)


class Page:
    def __init__(self, title: str, text: str, tables: list[list[list[str]]]) -> None:
        self.title = title
        self.text = text
        self.tables = tables

    def table_with(self, cell: str) -> list[list[str]]:
        """The first table with a cell that reads exactly `cell`."""
        for table in self.tables:
            if any(cell in row for row in table):
                return table
        raise AssertionError(f"no table on the page has a cell {cell!r}")

    def row(self, heading: str) -> list[str]:
        """The first table row whose first cell reads `heading`."""
        for table in self.tables:
            for row in table:
                if row and row[0] == heading:
                    return row
        raise AssertionError(f"no table row headed {heading!r}")


class _Cdp:
    """Requests and events of one DevTools connection (targets attached flat)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._next = 0
        self._events: list[dict[str, Any]] = []

    async def call(self, method: str, session: str | None = None, **params: Any) -> Any:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self._ws.send_str(json.dumps(message))
        while True:
            reply = await self._receive()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self._events.append(reply)

    async def event(self, method: str, session: str) -> dict[str, Any]:
        while True:
            for index, seen in enumerate(self._events):
                if seen.get("method") == method and seen.get("sessionId") == session:
                    return self._events.pop(index)
            self._events.append(await self._receive())

    async def evaluate(self, session: str, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate", session=session, expression=expression, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    async def _receive(self) -> dict[str, Any]:
        message = await self._ws.receive()
        if message.type != aiohttp.WSMsgType.TEXT:
            raise BrowserError(f"DevTools connection ended ({message.type.name})")
        reply: dict[str, Any] = json.loads(message.data)
        return reply
