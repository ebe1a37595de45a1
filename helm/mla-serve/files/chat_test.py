# helm test: one chat completion through the chart's Service (standard library only).
# Fails on an HTTP or transport error, on a length-cap runaway (finish_reason "length" with no
# visible content and no tool call: the DeepSeek-V4 bug signature), or on a wrong answer.
import json
import os
import sys
import urllib.error
import urllib.request

url = os.environ["MLA_SERVE_TEST_URL"].rstrip("/") + "/v1/chat/completions"
expect = os.environ.get("MLA_SERVE_TEST_EXPECT", "")
body = {
    "model": os.environ["MLA_SERVE_TEST_MODEL"],
    "messages": [{"role": "user", "content": os.environ["MLA_SERVE_TEST_PROMPT"]}],
    "max_tokens": int(os.environ.get("MLA_SERVE_TEST_MAX_TOKENS", "4096")),
    "temperature": 0,
}
request = urllib.request.Request(  # noqa: S310 (the URL is the chart's own Service)
    url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
)
try:
    with urllib.request.urlopen(  # noqa: S310 (the URL is the chart's own Service)
        request, timeout=float(os.environ.get("MLA_SERVE_TEST_TIMEOUT", "600"))
    ) as response:
        reply = json.load(response)
except (urllib.error.URLError, OSError, ValueError) as error:
    print(f"FAIL: POST {url}: {error}")
    sys.exit(1)

try:
    choice = reply["choices"][0]
except (KeyError, IndexError, TypeError):
    print(f"FAIL: no choices in the reply: {json.dumps(reply)[:500]}")
    sys.exit(1)
message = choice.get("message") or {}
content = (message.get("content") or "").strip()
finish = choice.get("finish_reason")
usage = reply.get("usage") or {}
details = usage.get("completion_tokens_details") or {}
print(
    f"finish_reason={finish} completion_tokens={usage.get('completion_tokens')} "
    f"reasoning_tokens={details.get('reasoning_tokens')} content={content[:200]!r}"
)
if finish == "length" and not content and not message.get("tool_calls"):
    print("FAIL: length-cap runaway: the model used every token and gave no answer")
    sys.exit(1)
if not content:
    print(f"FAIL: empty answer (finish_reason={finish})")
    sys.exit(1)
if expect and expect not in content:
    print(f"FAIL: expected {expect!r} in the answer")
    sys.exit(1)
print("PASS")
