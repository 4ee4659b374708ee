"""Issue 19, acceptance 2: the disaggregated soak in CI. Two minutes of the soak's calls (plain,
n > 1, stops, cancels, aborts, 5-300 ms deadlines, bad inputs) through a frontend with a prefill
and a decode pool of a tiny dummy model, while the producer is killed and restarted and a
router-style client leaves leases to expire, releases them or pulls them
(tandem/bench/disagg_soak.py). It ends with exactly one terminal status per call, no INTERNAL,
and nothing held on either engine: requests, blocks, state slots, leases, loads."""

from __future__ import annotations

from tandem.bench.disagg_soak import DisaggSoakOptions, run_disagg_soak
from tandem.bench.soak import SCENARIOS, SoakOptions, short_table


def test_disaggregated_soak_two_minutes_no_leaks_no_internal():
    soak = SoakOptions(num_requests=100_000, concurrency=8, max_seconds=120.0, max_tokens=16, seed=19, vocab_size=320)
    summary = run_disagg_soak(DisaggSoakOptions(soak=soak, model="dummy:tiny-qwen3", restart_every=45.0,
                                                router_every=0.5, lease_seconds=2.0))
    print("\n".join(short_table({"soak": summary})))
    print(f"restarts {summary['restarts']}, router {summary['router']} {summary['router_actions']}")
    assert summary["chaos_errors"] == []
    assert summary["internal"] == 0
    assert summary["num_unexpected"] == 0, summary["unexpected"]
    assert summary["num_violations"] == 0, summary["violations"]  # one terminal status per call
    assert summary["router_unexpected"] == {}
    assert summary["leaks"] == {}, summary["leaks"]
    assert {"kv_blocks_used", "state_slots_used", "kv_leases_active", "kv_loading_requests", "num_running",
            "in_flight", "frontend.in_flight"} <= set(summary["checked"])
    assert summary["restarts"] == 2  # the producer really went away, twice
    assert set(summary["outcomes"]) == set(SCENARIOS)
    totals = summary["totals"]
    assert totals.get("OK", 0) > 100 and totals.get("CANCELLED", 0) > 0 and totals.get("DEADLINE_EXCEEDED", 0) > 0
    # Leases were left to expire, released and pulled by the router while it all ran.
    assert summary["router"].get("OK", 0) > 20 and min(summary["router_actions"].values()) > 0
    assert summary["passed"]
