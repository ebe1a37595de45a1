"""The loop detector (mla_serve/sidecar/guard/loops.py) on the corpus of tests/loop_corpus.py.

Every loop shape is caught, streamed in several chunkings and checked whole, soon after the
loop reaches `min_repeats` units and `min_chars` characters; no legitimate text is ever
flagged, at any point of its stream, under the default settings.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from mla_serve.sidecar.guard.loops import LoopConfig, LoopMetrics, LoopPolicy, TailDetector
from mla_serve.sidecar.passthrough.runaways import Completion
from tests.loop_corpus import (
    CLOSING,
    LEGIT,
    LONG_UNIT,
    LOOPS,
    PARAGRAPH,
    PHRASE,
    REASONING_PREFIX,
    stream,
)

CHUNKINGS = ((4,), (1,), (3, 5, 4, 2, 6, 4), (17, 1, 9))
DEFAULT = LoopConfig()


def first_detection(text: str, sizes: tuple[int, ...], config: LoopConfig = DEFAULT):
    """(characters fed, (period, repeats)) at the first confirmation, or None."""
    detector, fed = TailDetector(config), 0
    for piece in stream(text, sizes):
        fed += len(piece)
        found = detector.feed(piece)
        if found is not None:
            return fed, found
    return None


@pytest.mark.parametrize("sizes", CHUNKINGS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_every_loop_shape_is_caught_soon(name: str, sizes: tuple[int, ...]) -> None:
    _, text = LOOPS[name]
    hit = first_detection(text, sizes)
    assert hit is not None, f"{name} was not caught"
    fed, (period, repeats) = hit
    assert repeats >= DEFAULT.min_repeats and period * (repeats + 1) > DEFAULT.min_chars
    # The loop starts right after the prefix; it is confirmed once it covers what the
    # definition asks (k units and min_chars), plus one check interval and one chunk.
    start = len(text) - period
    while start > 0 and text[start - 1] == text[start - 1 + period]:
        start -= 1
    needed = max(DEFAULT.min_repeats * period, DEFAULT.min_chars)
    assert fed <= start + needed + period + DEFAULT.check_every + max(sizes), (fed, start)
    assert text[-period:] * 2 in text  # the detected period is the loop's unit (or a divisor)


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_the_detected_period_is_the_unit(name: str) -> None:
    units = {"paragraph": len(PARAGRAPH), "phrase": len(PHRASE), "long_paragraph": len(LONG_UNIT),
             "single_token": 4, "content_sentence": len(CLOSING), "newlines": 1}  # fmt: skip
    hit = first_detection(LOOPS[name][1], (4,))
    assert hit is not None
    if name in units:
        assert hit[1][0] == units[name]


@pytest.mark.parametrize("sizes", CHUNKINGS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(LEGIT))
def test_legitimate_repetition_is_never_a_loop(name: str, sizes: tuple[int, ...]) -> None:
    _, text = LEGIT[name]
    assert first_detection(text, sizes) is None, f"false positive on {name}"
    assert TailDetector(DEFAULT).feed_all(text) is None


def test_legitimate_texts_are_long_enough_to_matter() -> None:
    """The corpus is not trivially short: each legit text exceeds the minimum loop span."""
    short = [name for name, (_, text) in LEGIT.items() if len(text) < DEFAULT.min_chars]
    assert short == ["dotted_pause"]  # kept on purpose: a run of dots inside a sentence


def test_whole_text_check_finds_loops_that_ran_to_the_end() -> None:
    for name, (_, text) in LOOPS.items():
        assert TailDetector(DEFAULT).feed_all(text) is not None, name
    # A loop that ended (the model moved on) is not in the tail of the final text.
    recovered = LOOPS["phrase"][1][:3000] + LEGIT["long_reasoning"][1]
    assert TailDetector(DEFAULT).feed_all(recovered) is None


def test_settings_change_what_counts() -> None:
    text = REASONING_PREFIX + "Check again. " * 60  # 13-char unit over 780 characters
    assert first_detection(text, (4,)) is None  # under min_chars 1024
    looser = LoopConfig(min_chars=512)
    hit = first_detection(text, (4,), looser)
    assert hit is not None and hit[1][0] == 13
    paragraph = LOOPS["paragraph"][1][:5000]
    assert first_detection(paragraph, (4,), LoopConfig(min_repeats=20)) is None
    assert first_detection(paragraph, (4,), LoopConfig(min_repeats=3)) is not None
    # A unit longer than window / k is never a candidate.
    assert first_detection(LOOPS["long_paragraph"][1], (4,), LoopConfig(window_chars=2048)) is None


def test_bad_settings_are_named() -> None:
    assert LoopConfig(min_repeats=1).problems() == ["--loop-min-repeats must be at least 2"]
    assert LoopConfig(min_chars=10).problems()
    assert LoopConfig(window_chars=512).problems() == [
        "--loop-window-chars must be at least --loop-min-chars"
    ]


def test_memory_per_choice_is_bounded() -> None:
    """The tail stays within twice the window; what waits for the next look within the
    characters no loop can be confirmed in (the quiet stretch, or the first min_chars)."""
    detector = TailDetector(DEFAULT)
    waiting = max(DEFAULT.quiet_chars, DEFAULT.min_chars) + DEFAULT.check_every + 4
    for piece in stream(LEGIT["long_reasoning"][1] * 10, (4,)):
        detector.feed(piece)
        assert len(detector.tail) <= 2 * DEFAULT.window_chars
        assert sum(map(len, detector.pieces)) <= waiting


def chunk(index: int, **delta: str) -> dict[str, object]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
    }


def test_a_stop_waits_until_every_running_choice_loops() -> None:
    metrics = LoopMetrics(CollectorRegistry())
    policy = LoopPolicy(action="stop")
    guard = policy.watch({"max_tokens": 5000, "n": 2}, "m", metrics, chat=True)
    assert guard is not None
    for index in (0, 1):
        guard.add_chunk(chunk(index, role="assistant", content=""))
    loop = list(stream(LOOPS["phrase"][1], (4,)))
    legit = list(stream(LEGIT["long_reasoning"][1], (4,)))
    stopped_at = None
    for step, (looping, fine) in enumerate(zip(loop, legit, strict=False)):
        if guard.add_chunk(chunk(0, reasoning=looping)):
            stopped_at = step
            break
        guard.add_chunk(chunk(1, reasoning=fine))
    assert stopped_at is None and guard.watches[0].loop is not None  # choice 1 still thinks
    finish = chunk(1, content="done")
    finish["choices"][0]["finish_reason"] = "stop"  # type: ignore[index]
    assert guard.add_chunk(finish)  # now only the looping choice runs: stop
    ending = guard.ending(include_usage=False).decode()
    assert '"index":0' in ending and '"index":1' not in ending
    assert '"stop_reason":"loop_detected"' in ending and ending.endswith("data: [DONE]\n\n")
    completion = Completion()
    completion.add_chunk(chunk(0, reasoning="x"))
    guard.settle(completion)
    assert completion.choices[0].finish_reason == "length" and completion.choices[0].loop


def test_off_and_per_model_actions() -> None:
    metrics = LoopMetrics(CollectorRegistry())
    policy = LoopPolicy(action="observe", model_actions={"a": "stop", "b": "off"})
    assert policy.watch({}, "b", metrics, chat=True) is None
    guard = policy.watch({}, "a", metrics, chat=True)
    assert guard is not None and guard.action == "stop" and guard.max_tokens is None
    other = policy.watch({"max_completion_tokens": 7, "max_tokens": 9}, "c", metrics, chat=True)
    assert other is not None and other.action == "observe" and other.max_tokens == 7
    completions = policy.watch({}, "c", metrics, chat=False)
    assert completions is not None and completions.max_tokens == 16  # vLLM's default


def test_vllm_defaults_are_set_only_where_missing() -> None:
    policy = LoopPolicy(
        repetition_detection={"max_pattern_size": 64, "min_count": 8}, thinking_token_budget=9000
    )
    request: dict[str, object] = {"model": "m"}
    assert policy.apply_defaults(request)
    assert request["repetition_detection"] == {"max_pattern_size": 64, "min_count": 8}
    assert request["thinking_token_budget"] == 9000
    own: dict[str, object] = {"repetition_detection": {"max_pattern_size": 4, "min_count": 3},
                              "thinking_token_budget": 10}  # fmt: skip
    assert not policy.apply_defaults(own)
    assert own["thinking_token_budget"] == 10
    assert not LoopPolicy().apply_defaults({"model": "m"})


def test_odd_chunks_are_ignored_not_fatal() -> None:
    """Whatever shape a chunk has, the guard neither raises nor counts text that is not text."""
    metrics = LoopMetrics(CollectorRegistry())
    guard = LoopPolicy(action="stop").watch({"max_tokens": 10}, "m", metrics, chat=True)
    assert guard is not None
    odd: list[dict[str, object]] = [
        {"choices": None},
        {"choices": "abc"},
        {"choices": [None, 3, "x"]},
        {"choices": [{"index": "0", "delta": {"reasoning": "x"}}]},
        {"choices": [{"index": 0, "delta": ["reasoning"]}]},
        {"choices": [{"index": 0, "delta": {"reasoning": {"a": 1}, "content": 5}}]},
        {"choices": [{"index": 1, "text": ["t"]}]},
        {"id": None, "choices": [{"index": 2**40, "delta": {}}]},
    ]
    for chunk in odd:
        assert guard.add_chunk(chunk) is False
    assert all(watch.detector.tail == "" for watch in guard.watches.values())
    assert all(not watch.detector.pieces for watch in guard.watches.values())


# -- points passed without a look find the same loops ------------------------------------------
Hit = tuple[int, tuple[int, int]] | None  # (index of the token, (period, repeats)), or None


def looked_at_every_point(config: LoopConfig, texts: list[str]) -> Hit:
    """The detector's definition with a search at every point (a token's end once
    `check_every` characters came): (index of the token, (period, repeats)) at the first
    confirmation, or None. Written here from the definition, as the reference."""
    tail, fresh = "", 0
    for index, text in enumerate(texts):
        tail, fresh = tail + text, fresh + len(text)
        if fresh < config.check_every:
            continue
        fresh = 0
        if len(tail) > 2 * config.window_chars:
            tail = tail[-config.window_chars :]
        size = len(tail)
        if size < config.min_chars:
            continue
        probe = tail[-config.probe_chars :]
        first = max(size - config.probe_chars - config.max_period, 0)
        end = size - 1
        for _ in range(config.max_candidates):
            start = tail.rfind(probe, first, end)
            if start < 0:
                break
            period = size - config.probe_chars - start
            span = max(config.min_repeats * period, config.min_chars)
            if span > size:
                break
            if tail[size - span + period :] == tail[size - span : size - period]:
                while span + period <= size and (
                    tail[size - span - period : size - span]
                    == tail[size - span : size - span + period]
                ):
                    span += period
                return index, (period, span // period)
            end = start + config.probe_chars - 1
    return None


def token_by_token(config: LoopConfig, texts: list[str]) -> Hit:
    detector = TailDetector(config)
    for index, text in enumerate(texts):
        found = detector.feed(text)
        if found is not None:
            return index, found
    return None


def handed_over(config: LoopConfig, texts: list[str]) -> Hit:
    """As the C lane hands texts over: kept until they reach `until_check()`, then at once."""
    detector, kept, budget = TailDetector(config), [], TailDetector(config).until_check()
    for index, text in enumerate(texts):
        kept.append(text)
        budget -= len(text)
        if budget > 0:
            continue
        found = detector.feed_texts(kept)
        kept.clear()
        if found is not None:
            return index, found
        budget = detector.until_check()
    return None


WORDS = ("the ", "loop ", "check ", "again", ". ", "\n", "so ", "x", "value ", "= ", "a1 ", "é ")


def generated(seed: int, segments: int) -> str:
    """Prose of a small vocabulary (probes that recur) and exact repetitions of its pieces."""
    rng, out = random.Random(seed), []
    for _ in range(segments):
        unit = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        out.append(unit * (rng.choice((1, 1, 2, 3, 5, 9, 40)) if rng.random() < 0.6 else 1))
    return "".join(out)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    segments=st.integers(1, 40),
    repeats=st.integers(2, 5),
    min_chars=st.integers(20, 400),
    window_extra=st.integers(0, 600),
    check_every=st.integers(1, 48),
    probe_chars=st.integers(4, 19),
    max_candidates=st.integers(1, 8),
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=6),
)
def test_passing_points_finds_the_same_loops_at_the_same_points(
    seed, segments, repeats, min_chars, window_extra, check_every, probe_chars, max_candidates,
    sizes,
) -> None:  # fmt: skip
    config = LoopConfig(min_repeats=repeats, min_chars=max(min_chars, probe_chars + 1),
                        window_chars=max(min_chars, probe_chars + 1) + window_extra,
                        check_every=check_every, probe_chars=probe_chars,
                        max_candidates=max_candidates)  # fmt: skip
    assert not config.problems()
    texts = list(stream(generated(seed, segments), tuple(sizes)))
    expected = looked_at_every_point(config, texts)
    assert token_by_token(config, texts) == expected
    assert handed_over(config, texts) == expected


@pytest.mark.parametrize("name", sorted(LOOPS) + sorted(LEGIT))
def test_the_corpus_is_found_at_the_same_points(name: str) -> None:
    """Every corpus text, in every chunking, token by token and handed over as the lane
    does: the same answer at the same token as looking at every point."""
    text = (LOOPS | LEGIT)[name][1]
    for sizes in CHUNKINGS:
        texts = list(stream(text, sizes))
        expected = looked_at_every_point(DEFAULT, texts)
        assert (expected is None) == (name in LEGIT)
        assert token_by_token(DEFAULT, texts) == expected
        assert handed_over(DEFAULT, texts) == expected


def test_ordinary_text_is_searched_rarely(monkeypatch) -> None:
    """On long prose the detector searches about once per quiet stretch, not at every point."""
    looks = 0
    original = TailDetector.check

    def counted(self: TailDetector) -> tuple[int, int] | None:
        nonlocal looks
        looks += 1
        return original(self)

    monkeypatch.setattr(TailDetector, "check", counted)
    detector = TailDetector(DEFAULT)
    text = LEGIT["long_reasoning"][1] * 4
    points = 0
    for piece in stream(text, (4,)):
        fresh = detector.fresh + len(piece)
        points += fresh >= DEFAULT.check_every
        detector.feed(piece)
    assert points > 20 * looks > 0, (points, looks)
