"""W3C trace-context parsing, generation and propagation (tandem/tracing.py)."""

from __future__ import annotations

import re

import pytest

from tandem.tracing import TraceContext, TraceParent, clean_tracestate, parse_traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_parse_valid_traceparent():
    tp = parse_traceparent(VALID)
    assert tp == TraceParent(TRACE, SPAN, 1)
    assert tp.sampled
    assert tp.header() == VALID
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        f"00-{TRACE.upper()}-{SPAN}-01",  # uppercase hex is invalid
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TRACE}-{SPAN}-01",  # version ff is forbidden
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00_{TRACE}_{SPAN}_01",  # wrong separators
        f"00-{TRACE}-{SPAN}-0g",  # non-hex flags
        f"0-{TRACE}-{SPAN}-01",
    ],
)
def test_invalid_traceparent_is_rejected(value):
    assert parse_traceparent(value) is None


def test_future_version_parses_its_first_four_fields():
    tp = parse_traceparent(f"cc-{TRACE}-{SPAN}-01-what-the-future-holds")
    assert tp == TraceParent(TRACE, SPAN, 1)
    assert parse_traceparent(f"cc-{TRACE}-{SPAN}-01x") is None  # no separator after the flags


def test_context_continues_the_callers_trace_with_a_new_span():
    ctx = TraceContext.from_metadata([("x-other", "1"), ("traceparent", VALID), ("tracestate", "congo=t61rcWkgMzE")])
    assert ctx.trace_id == TRACE
    assert ctx.parent_span_id == SPAN
    assert ctx.span_id != SPAN and re.fullmatch(r"[0-9a-f]{16}", ctx.span_id)
    assert ctx.flags == 1
    # Downstream, this service's span is the parent; the trace and the state travel unchanged.
    md = dict(ctx.outgoing_metadata())
    sent = parse_traceparent(md["traceparent"])
    assert sent == TraceParent(TRACE, ctx.span_id, 1)
    assert md["tracestate"] == "congo=t61rcWkgMzE"
    assert ctx.log_fields() == {"trace_id": TRACE, "span_id": ctx.span_id, "parent_span_id": SPAN}


def test_missing_traceparent_starts_a_new_trace():
    a = TraceContext.from_metadata([("tracestate", "congo=t61rcWkgMzE")])
    b = TraceContext.from_metadata(None)
    for ctx in (a, b):
        assert re.fullmatch(r"[0-9a-f]{32}", ctx.trace_id) and ctx.trace_id != "0" * 32
        assert ctx.parent_span_id is None
        assert ctx.tracestate is None  # state without a parent is meaningless: dropped
        assert parse_traceparent(ctx.traceparent()) is not None  # what we generate is valid
        assert "parent_span_id" not in ctx.log_fields()
    assert a.trace_id != b.trace_id


def test_invalid_traceparent_starts_a_new_trace_and_drops_tracestate():
    ctx = TraceContext.from_metadata([("traceparent", f"00-{'0' * 32}-{SPAN}-01"), ("tracestate", "a=b")])
    assert ctx.trace_id != "0" * 32 and ctx.parent_span_id is None and ctx.tracestate is None
    assert dict(ctx.outgoing_metadata()).keys() == {"traceparent"}


def test_binary_metadata_and_header_case():
    ctx = TraceContext.from_metadata([("traceparent-bin", b"\x00"), ("TraceParent", VALID)])
    assert ctx.trace_id == TRACE


def test_tracestate_joining_and_limits():
    assert clean_tracestate(["a=1, b=2", "c=3"]) == "a=1,b=2,c=3"
    assert clean_tracestate([]) is None
    assert clean_tracestate(["no-equals-sign"]) is None
    assert clean_tracestate([",".join(f"k{i}=v" for i in range(33))]) is None  # over 32 members
    assert clean_tracestate(["k=" + "v" * 600]) is None  # over 512 characters
    assert clean_tracestate(["k=v\u00e9"]) is None  # not printable ASCII
