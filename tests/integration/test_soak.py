"""Soak (issue 10, acceptance 3): ~2 minutes of random cancels, aborts, short deadlines, n > 1,
stops and bad inputs against the shared live server, then exactly one terminal status per call
with an accepted outcome for its scenario, and nothing leaked (frontend IDs and choice mappings,
engine sequences, in-flight requests, KV blocks, state slots)."""

from __future__ import annotations

from tandem.bench.soak import SCENARIOS, SoakOptions, run_soak, short_table


def test_soak_two_minutes_no_leaks_one_terminal_status_each(serve):
    opts = SoakOptions(num_requests=100_000, concurrency=8, max_seconds=100.0, max_tokens=16, seed=10)
    summary = run_soak(serve["frontend"], opts)
    print("\n".join(short_table({"soak": summary})))
    assert summary["num_unexpected"] == 0, summary["unexpected"]
    assert summary["num_violations"] == 0, summary["violations"]
    assert summary["leaks"] == {}, summary["leaks"]
    assert {"frontend.in_flight", "frontend.in_flight_choices", "kv_blocks_used", "group_blocks_used",
            "state_slots_used", "num_running"} <= set(
        summary["checked"])
    assert set(summary["outcomes"]) == set(SCENARIOS)  # every scenario really ran
    totals = summary["totals"]
    assert totals.get("CANCELLED", 0) > 0 and totals.get("DEADLINE_EXCEEDED", 0) > 0
    assert totals.get("INVALID_ARGUMENT", 0) > 0 and totals.get("OK", 0) > 0
    assert summary["calls"] >= 100
    assert summary["passed"]
