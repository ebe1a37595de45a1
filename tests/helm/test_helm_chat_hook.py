"""`helm test`: the chat request the hook pod runs, against a stand-in OpenAI server."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from tests.helm.helm_support import case_documents, find, run

ANSWER = {"role": "assistant", "content": "42", "reasoning": "17 + 25 = 42"}
RUNAWAY = {"role": "assistant", "content": None, "reasoning": "Let me think. " * 400}


def completion(message: dict[str, Any], finish: str, tokens: int = 12) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "deepseek-ai/DeepSeek-V4-Flash",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": 20,
            "completion_tokens": tokens,
            "completion_tokens_details": {"reasoning_tokens": tokens - 1},
        },
    }


class StandIn(BaseHTTPRequestHandler):
    reply: ClassVar[tuple[int, dict[str, Any]]] = (200, {})
    requests: ClassVar[list[tuple[str, dict[str, Any]]]] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).requests.append((self.path, json.loads(self.rfile.read(length))))
        status, body = type(self).reply
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def hook() -> tuple[str, dict[str, str]]:
    pod = find(case_documents("profile-dsv4-flash"), "Pod")
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python3", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    return container["args"][0], env


def run_hook(hook: tuple[str, dict[str, str]], url: str, reply: tuple[int, dict[str, Any]]):
    script, env = hook
    StandIn.reply = reply
    StandIn.requests = []
    return run(
        [sys.executable, "-c", script],
        env={**env, "MLA_SERVE_TEST_URL": url, "MLA_SERVE_TEST_TIMEOUT": "10"},
        timeout=60,
    )


def test_a_right_answer_passes(server: str, hook: tuple[str, dict[str, str]]) -> None:
    result = run_hook(hook, server, (200, completion(ANSWER, "stop")))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    ((path, body),) = StandIn.requests
    assert path == "/v1/chat/completions"
    assert body["model"] == "deepseek-ai/DeepSeek-V4-Flash"
    assert body["max_tokens"] == 4096
    assert body["messages"][0]["content"].startswith("What is 17 + 25?")


def test_a_length_cap_runaway_fails(server: str, hook: tuple[str, dict[str, str]]) -> None:
    result = run_hook(hook, server, (200, completion(RUNAWAY, "length", tokens=4096)))
    assert result.returncode == 1
    assert "FAIL: length-cap runaway" in result.stdout
    assert "reasoning_tokens=4095" in result.stdout


def test_an_answer_cut_at_the_cap_is_not_a_runaway(
    server: str, hook: tuple[str, dict[str, str]]
) -> None:
    cut = {"role": "assistant", "content": "The answer is 42, because"}
    result = run_hook(hook, server, (200, completion(cut, "length")))
    assert result.returncode == 0, result.stdout


def test_a_wrong_answer_fails(server: str, hook: tuple[str, dict[str, str]]) -> None:
    wrong = {"role": "assistant", "content": "41"}
    result = run_hook(hook, server, (200, completion(wrong, "stop")))
    assert result.returncode == 1
    assert "expected '42'" in result.stdout


def test_an_error_status_fails(server: str, hook: tuple[str, dict[str, str]]) -> None:
    result = run_hook(hook, server, (500, {"error": {"message": "engine dead"}}))
    assert result.returncode == 1
    assert "HTTP Error 500" in result.stdout


def test_no_server_fails(hook: tuple[str, dict[str, str]]) -> None:
    result = run_hook(hook, "http://127.0.0.1:9", (200, {}))
    assert result.returncode == 1
    assert "FAIL: POST" in result.stdout
