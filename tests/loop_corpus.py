"""The loop guard's corpus: loop shapes it must catch, and repetitive text it must never flag.

Loops (`LOOPS`), each a text that starts sensibly and then repeats a unit until the length
cap, in the channel where it happens:

* ``paragraph``: the DeepSeek-V4 report's shape, one reasoning paragraph (about 420
  characters) repeated verbatim;
* ``long_paragraph``: a 900-character unit, close to the longest period (window / k);
* ``phrase``: a short phrase ("Let me verify this again.") repeated hundreds of times;
* ``single_token``: one token over and over, what greedy decoding on dummy weights does;
* ``content_sentence``: the answer (content, not reasoning) stuck on its closing sentence;
* ``content_code_line``: an answer's code block stuck on one line;
* ``newlines``: a run of blank lines after a sentence.

Legitimate output (`LEGIT`) that must never count as a loop, streamed in any chunking: counting
1..500 (comma- and line-separated), markdown tables (uniform rows, a 40-column separator),
code with repeated lines (identical asserts, a 64-zero initializer, banner comments, repeated
test bodies), long non-periodic reasoning (prose and a 60-step long multiplication), lists
of similar items, a JSON array of similar records, a song with a refrain, spaced-out dots.

`stream(text, sizes)` cuts a text into deltas of cycling sizes, as a tokenizer would.
"""

from __future__ import annotations

from collections.abc import Iterator

REASONING_PREFIX = (
    "The user asks why the DeepSeek-V4 request never returns an answer. First, the indexer "
    "selects the top 512 compressed blocks for each query; when the cached prefix is longer "
    "than 2048 tokens the C4 layers have more than 512 candidates, so scoring matters. Second, "
    "under breakable CUDA graphs the metadata built at capture time may differ from replay. "
    "I should check whether the shortcut for short contexts was baked into the graph. "
)

PARAGRAPH = (
    "Wait, I need to double-check the candidate count. If the context is 4096 tokens and the "
    "compression ratio is 4, there are 1024 compressed blocks, which is more than 512, so the "
    "learned indexer has to score them. But during capture the dummy metadata has a short "
    "sequence, so the shortcut fills indices 0 to 511 directly. That means replay uses the "
    "same fixed indices. Let me re-check this reasoning once more from the beginning. "
)

LONG_UNIT = (
    "Let me restate the whole problem carefully before answering. We have a sparse attention "
    "layer that keeps 2048 key blocks per query, a lightning indexer that scores compressed "
    "blocks, and a CUDA graph that was captured with short dummy metadata. During replay the "
    "metadata tensors are refreshed in place, but the shapes that were baked into the graph "
    "do not change, so any branch that was decided on the host at capture time stays decided. "
    "The branch in question compares the longest sequence of the batch, divided by the "
    "compression ratio, with the number of blocks the indexer keeps. With dummy metadata the "
    "comparison says the context is short, so the graph records a fill of the first indices "
    "instead of the scoring kernel. On replay with a long cached prefix the scoring should run "
    "but does not. The model then attends to the wrong blocks. I think that is the cause. "
)

PHRASE = "Let me verify this again. "

ANSWER_PREFIX = (
    "The runaway comes from the indexer shortcut being captured into the CUDA graph. To fix "
    "it, upgrade to vLLM 0.28.0 or later, or apply the dsv4-indexer-capture-shortcut patch. "
)

CLOSING = "I hope this helps! If you have any other questions, feel free to ask. "

CODE_PREFIX = (
    "Here is a minimal reproduction:\n\n```python\nimport openai\n\n"
    "client = openai.OpenAI(base_url='http://localhost:8000/v1', api_key='x')\n"
    "for i in range(16):\n"
)

CODE_LINE = "    response = client.chat.completions.create(model='dsv4', messages=messages)\n"


def _fill(prefix: str, unit: str, total: int) -> str:
    """`prefix`, then `unit` repeated to `total` characters (cut mid-unit, as a cap cuts)."""
    body = unit * (max(total - len(prefix), 0) // len(unit) + 1)
    return (prefix + body)[:total]


LOOPS: dict[str, tuple[str, str]] = {  # name -> (channel, text)
    "paragraph": ("reasoning", _fill(REASONING_PREFIX, PARAGRAPH, 24000)),
    "long_paragraph": ("reasoning", _fill(REASONING_PREFIX, LONG_UNIT, 24000)),
    "phrase": ("reasoning", _fill(REASONING_PREFIX, PHRASE, 24000)),
    "single_token": ("reasoning", _fill(REASONING_PREFIX, " the", 24000)),
    "content_sentence": ("content", _fill(ANSWER_PREFIX, CLOSING, 24000)),
    "content_code_line": ("content", _fill(CODE_PREFIX, CODE_LINE, 24000)),
    "newlines": ("content", _fill(ANSWER_PREFIX, "\n", 24000)),
}


def counting_commas() -> str:
    return "Counting from 1 to 500: " + ", ".join(str(i) for i in range(1, 501)) + "."


def counting_lines() -> str:
    return "".join(f"{i}\n" for i in range(1, 501))


def markdown_table() -> str:
    rows = ["| # | item | price | in stock |", "|---|------|-------|----------|"]
    for i in range(1, 121):
        rows.append(f"| {i} | widget | {i * 1.25:.2f} | {'yes' if i % 3 else 'no'} |")
    return "\n".join(rows) + "\n"


def wide_table() -> str:
    header = "| " + " | ".join(f"c{i}" for i in range(40)) + " |"
    rule = "|" + "---|" * 40
    rows = ["| " + " | ".join(str((r * 7 + c) % 10) for c in range(40)) + " |" for r in range(12)]
    return "\n".join([header, rule, *rows]) + "\n"


def repeated_asserts() -> str:
    lines = []
    for name in ("cache", "rank", "stride", "workspace", "graph"):
        lines += [f"def test_{name}_is_stable():", f"    value = build_{name}()"]
        lines += [f"    assert value.{name} == expected.{name}"] * 8 + [""]
    return "\n".join(lines) + "\n"


def zero_initializer() -> str:
    return (
        "static const int kTable[256] = {" + ", ".join(["0"] * 256) + "};\n"
        "static const float kScale[64] = {" + ", ".join(["1.0f"] * 64) + "};\n"
    )


def banner_comments() -> str:
    bar = "#" * 78 + "\n"
    sections = ("imports", "configuration", "helpers", "engine", "sidecar", "main")
    return "".join(f"{bar}# {name}\n{bar}\nx_{name} = None\n\n" for name in sections)


def repeated_test_bodies() -> str:
    body = (
        "    engine = make_engine(tp={tp})\n"
        "    out = engine.generate(prompt, max_tokens=16)\n"
        "    assert out.finish_reason == 'length'\n"
        "    assert len(out.token_ids) == 16\n"
    )
    return "".join(
        f"def test_generate_tp{tp}():\n" + body.format(tp=tp) + "\n"
        for tp in (1, 2, 4, 8, 16, 32, 64)
    )


def long_reasoning() -> str:
    text = (
        "Okay, so the question is how much memory the workspace needs under decode context "
        "parallelism. Let me think about what the kernel stores. For every token in the batch "
        "and every head on this rank it keeps the softmax statistics, two floats, and it does "
        "so for each DCP rank's partial result, because the partials are merged afterwards. "
        "So the slab is eight bytes times heads per rank times DCP size times tokens. With 64 "
        "heads per rank, DCP 4 and 4096 batched tokens that is 8 * 64 * 4 * 4096, which is "
        "8,388,608 bytes, and there is a second buffer of the same kind for the output "
        "accumulators, which are 512 wide. Hmm, that one is bigger: 512 values of two bytes "
        "each per head per token per rank. Let me recompute: 1024 bytes times 64 heads is "
        "65,536 bytes per token per rank; times 4 ranks is 262,144; times 4096 tokens gives "
        "1,073,741,824 bytes, exactly one GiB. Adding the default 394 MiB workspace, and the "
        "statistics, we land near 2.39 GiB, which matches the figure in the pull request. "
        "Now, what happens at 32768 batched tokens? Everything that scales with tokens grows "
        "eightfold, so the accumulators alone become 8 GiB and the total about 16.4 GiB. That "
        "explains the negative KV budget on the B200: 179 GiB times 0.96 leaves 171.9, minus "
        "the weights, minus 16.4, minus the activation peak, and nothing is left for the "
        "cache. The fix is either to lower max-num-batched-tokens to 4096 or to choose a "
        "backend that does not allocate this workspace at all, such as FlashMLA sparse, which "
        "vLLM picks anyway when PCP and DCP are combined. I should also mention the override "
        "variable, which replaces the whole size and warns when it is too small. "
    )
    steps = []
    a, b = 987654321, 123456789
    for i, digit in enumerate(reversed(str(b))):
        partial = a * int(digit)
        steps.append(
            f"Step {i + 1}: multiply {a} by the digit {digit} in position {i}, giving {partial}; "
            f"shifted by {i} places that is {partial * 10**i}, and the running total becomes "
            f"{sum(a * int(d) * 10**j for j, d in enumerate(reversed(str(b))) if j <= i)}. "
        )
    squares = "".join(f"The square of {n} is {n * n}, and its cube is {n**3}. " for n in range(60))
    return text + "".join(steps) + squares


def similar_items() -> str:
    colors = ["red", "green", "blue", "amber", "violet", "teal"]
    lines = [
        f"{i}. Option {i}: a {colors[i % 6]} node pool with {2 ** (i % 5)} GPUs, "
        f"priority {100 - i}."
        for i in range(1, 81)
    ]
    return "Here are the candidate layouts:\n" + "\n".join(lines) + "\n"


def json_records() -> str:
    records = [
        f'  {{"id": {i}, "name": "user_{i:03d}", "active": {"true" if i % 4 else "false"}}}'
        for i in range(1, 101)
    ]
    return "[\n" + ",\n".join(records) + "\n]\n"


def song_with_refrain() -> str:
    refrain = (
        "And the kernels run, and the graphs replay,\n"
        "the tokens flow through the night and day,\n"
        "and the cache holds on to what we say.\n\n"
    )
    verses = [
        "We captured shapes when the batch was small,\nand thought one size fit them all.\n\n",
        "The indexer scored what it should not skip,\nuntil a patch fixed the faulty slip.\n\n",
        "Now long prompts come and the answers too,\nthe runaway's gone and the sky is blue.\n\n",
        "So page the team when the loops come back,\nand read the runbook to get on track.\n\n",
        "The sidecar counts what the engine wrote,\nand stops the loops before they bloat.\n\n",
    ]
    return "".join(verse + refrain for verse in verses)


def dotted_pause() -> str:
    return "Let me think" + "." * 200 + " Okay, the answer is 42.\n"


LEGIT: dict[str, tuple[str, str]] = {  # name -> (channel, text)
    "counting_commas": ("content", counting_commas()),
    "counting_lines": ("content", counting_lines()),
    "markdown_table": ("content", markdown_table()),
    "wide_table": ("content", wide_table()),
    "repeated_asserts": ("content", repeated_asserts()),
    "zero_initializer": ("content", zero_initializer()),
    "banner_comments": ("content", banner_comments()),
    "repeated_test_bodies": ("content", repeated_test_bodies()),
    "long_reasoning": ("reasoning", long_reasoning()),
    "similar_items": ("content", similar_items()),
    "json_records": ("content", json_records()),
    "song_with_refrain": ("content", song_with_refrain()),
    "dotted_pause": ("reasoning", dotted_pause()),
}


def stream(text: str, sizes: tuple[int, ...] = (3, 5, 4, 2, 6, 4)) -> Iterator[str]:
    """`text` cut into deltas whose lengths cycle through `sizes` (about one token each)."""
    index, position = 0, 0
    while position < len(text):
        size = sizes[index % len(sizes)]
        yield text[position : position + size]
        position += size
        index += 1
