"""Issue 21, acceptance 3 (priority): on a real `tandem serve --scheduling-policy priority` with room
for one running request, a high-priority request sent after three low-priority ones that are
already queued finishes before the queued ones."""

from __future__ import annotations

import threading
import time

from tandem.client import TandemClient

LONG = "Count from one to one hundred:"


def test_a_high_priority_request_overtakes_queued_low_priority_ones(launch_serve):
    _, frontend, _ = launch_serve(["--scheduling-policy", "priority", "--max-num-seqs", "1",
                                   "--frontend-workers", "1"])
    finished: dict[str, float] = {}

    def run(name: str, priority: int, max_tokens: int) -> None:
        with TandemClient(frontend) as client:
            reply = client.generate(LONG, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                                    priority=priority, timeout=300)
            assert reply.usage.completion_tokens == max_tokens
        finished[name] = time.monotonic()

    with TandemClient(frontend) as client:
        client.generate("Hi", max_tokens=1)  # warm: the first request pays one-time costs

        def queued() -> int:
            return int(sum(e["num_waiting"] for e in client.utility("stats")["engines"].values()))

        threads = []
        for i in range(3):
            t = threading.Thread(target=run, args=(f"low-{i}", 5, 24))
            t.start()
            threads.append(t)
            time.sleep(0.3)  # arrival order low-0, low-1, low-2
        deadline = time.monotonic() + 60
        while queued() < 2 and time.monotonic() < deadline:  # low-1 and low-2 wait behind low-0
            time.sleep(0.05)
        assert queued() >= 2
        urgent = threading.Thread(target=run, args=("urgent", 0, 4))
        urgent.start()
        for t in [*threads, urgent]:
            t.join(timeout=300)
    assert set(finished) == {"low-0", "low-1", "low-2", "urgent"}
    assert finished["urgent"] < finished["low-1"] < finished["low-2"], finished
