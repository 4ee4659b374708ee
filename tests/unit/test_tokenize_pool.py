"""TokenizePool: one tokenizer per thread, never shared; a bounded queue (issue #10, failure 2)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem.frontend.tokenize_pool import TokenizePool, TokenizerBusy


class _Tokenizer:
    """Stands in for TextTokenizer: records which threads used each clone."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.clones: list[_Tokenizer] = []

    def clone(self) -> "_Tokenizer":
        twin = _Tokenizer()
        self.clones.append(twin)
        return twin


def _work(tok: _Tokenizer, seconds: float) -> int:
    tok.threads.add(threading.get_ident())
    time.sleep(seconds)
    return id(tok)


def test_each_thread_has_its_own_tokenizer_and_jobs_run_in_parallel():
    source = _Tokenizer()
    pool = TokenizePool(source, workers=3, max_pending=8)

    async def scenario():
        started = time.monotonic()
        used = await asyncio.gather(*(pool.run(_work, 0.3) for _ in range(3)))
        return used, time.monotonic() - started

    used, elapsed = asyncio.run(scenario())
    pool.close()
    assert elapsed < 0.6  # three 0.3 s jobs at once, not one after another
    assert len(set(used)) == 3 and id(source) not in used  # clones only, one per job here
    assert all(len(c.threads) <= 1 for c in source.clones)  # a clone never crosses threads
    assert not source.threads  # the original stays with the event loop


def test_queue_beyond_the_bound_is_refused_and_frees_up():
    pool = TokenizePool(_Tokenizer(), workers=1, max_pending=2)

    async def scenario():
        first = asyncio.ensure_future(pool.run(_work, 0.3))
        second = asyncio.ensure_future(pool.run(_work, 0.0))
        await asyncio.sleep(0.05)
        with pytest.raises(TokenizerBusy):
            await pool.run(_work, 0.0)
        second.cancel()  # a cancelled waiting job leaves the queue at once
        await asyncio.sleep(0.05)
        assert pool.pending == 1
        await first
        assert pool.pending == 0
        await pool.run(_work, 0.0)

    asyncio.run(scenario())
    pool.close()
