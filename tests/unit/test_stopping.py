"""Stop-string matching over streamed text: never leaks a stop string, holds back only what it must."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.stopping import StopMatch, StopStringMatcher


def run(stop, chunks, can_stop=None):
    m = StopStringMatcher(stop)
    out = []
    stopped = False
    for i, c in enumerate(chunks):
        r = m.feed(c, True if can_stop is None else can_stop[i])
        out.append(r.text)
        if r.stopped:
            stopped = True
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, m


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == StopMatch("abc", False)
    assert m.flush() == ""


def test_holds_back_a_possible_prefix_then_releases_it():
    m = StopStringMatcher(["END"])
    assert m.feed("hello E") == StopMatch("hello ", False)
    assert m.feed("N") == StopMatch("", False)
    assert m.feed("X") == StopMatch("ENX", False)


def test_stop_string_split_across_chunks_is_cut_before_it():
    m = StopStringMatcher(["END"])
    assert m.feed("abc E").text == "abc "
    r = m.feed("ND tail")
    assert r == StopMatch("", True) and m.matched == "END"
    assert m.feed("more") == StopMatch("", True)
    assert m.flush() == ""


def test_the_stop_string_completed_first_wins():
    text, stopped, m = run(["xyz", "b"], ["a", "xyzb"])
    assert (text, stopped, m.matched) == ("a", True, "xyz")
    # "c" completes before "bcd" does, whether the text comes at once or a character at a time.
    for chunks in (["abcd"], list("abcd")):
        text, stopped, m = run(["bcd", "c"], chunks)
        assert (text, stopped, m.matched) == ("ab", True, "c")
    # Same end: the longer (earlier-starting) one wins.
    text, stopped, m = run(["c", "bc"], ["abcd"])
    assert (text, stopped, m.matched) == ("a", True, "bc")


def test_overlapping_prefix():
    assert run(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)


def test_flush_returns_the_held_tail():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST").text == "go "
    assert m.flush() == "ST"


def test_text_before_min_tokens_cannot_stop_on_its_own():
    # "ab" arrives while stopping is not allowed; a later "ab" must still stop.
    text, stopped, _ = run(["ab"], ["xab", "cd", "ab", "zz"], can_stop=[False, True, True, True])
    assert (text, stopped) == ("xabcd", True)
    # A match that spans the boundary counts (it includes allowed text), as in vLLM.
    text, stopped, _ = run(["abc"], ["xa", "bc"], can_stop=[False, True])
    assert (text, stopped) == ("x", True)


def test_empty_stop_string_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


alphabet = st.text(alphabet="abc", min_size=0, max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    text=alphabet,
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_streaming_equals_truncating_the_whole_text(text, stops, cuts):
    """However the text is chunked, the output is the text before the first stop string to complete."""
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expect = text[: min(hits)[1]] if hits else text
    out, stopped, _ = run(stops, chunks)
    assert stopped == bool(hits)
    assert out == expect
    for s in stops:  # never leaks a stop string
        assert s not in out


@settings(max_examples=200, deadline=None)
@given(text=alphabet, stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3))
def test_emits_everything_that_cannot_start_a_stop_string(text, stops):
    """The held-back tail is shorter than the longest stop string and is a prefix of one."""
    m = StopStringMatcher(stops)
    emitted = ""
    for ch in text:
        r = m.feed(ch)
        emitted += r.text
        if r.stopped:
            return
        held = m._buf
        assert len(held) < max(map(len, stops))
        assert held == "" or any(s.startswith(held) and len(s) > len(held) for s in stops)
