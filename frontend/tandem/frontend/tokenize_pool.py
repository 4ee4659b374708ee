"""Tokenizer work off the event loop: a fixed set of threads, one tokenizer each, a bounded queue.

Hugging Face fast tokenizers must not be shared between threads, and `TextTokenizer` serialises
its calls with a lock; a long prompt tokenized on a shared instance would hold that lock while
the event loop waits on it to detokenize everyone else's tokens. So each worker thread owns a
clone, and the event loop keeps the original for detokenizing.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tandem.frontend.tokenizer import TextTokenizer

T = TypeVar("T")


class TokenizerBusy(RuntimeError):
    """More tokenizer jobs are queued than the pool accepts (maps to RESOURCE_EXHAUSTED)."""


class TokenizePool:
    """Runs `fn(tokenizer, *args)` on one of `workers` threads, each with its own tokenizer clone.

    Invariants: at most `workers` jobs run at once; at most `max_pending` jobs are queued or
    running (one more raises `TokenizerBusy` before queueing anything); a job whose caller was
    cancelled still counts until its thread finishes it, so cancels cannot overfill the pool.
    """

    def __init__(self, tokenizer: TextTokenizer, workers: int = 2, max_pending: int = 256) -> None:
        if workers < 1:
            raise ValueError("the tokenizer pool needs at least one worker")
        if max_pending < workers:
            raise ValueError("max_pending must be at least the number of workers")
        self.workers = workers
        self.max_pending = max_pending
        self._spares: queue.SimpleQueue[TextTokenizer] = queue.SimpleQueue()
        for _ in range(workers):
            self._spares.put(tokenizer.clone())
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pending = 0
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tandem-tokenize",
                                            initializer=self._adopt_tokenizer)

    def _adopt_tokenizer(self) -> None:
        self._local.tokenizer = self._spares.get_nowait()

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        return fn(self._local.tokenizer, *args)

    def _done(self, _future) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    async def run(self, fn: Callable[..., T], *args) -> T:
        with self._lock:
            if self._pending >= self.max_pending:
                raise TokenizerBusy(f"{self._pending} prompts are waiting for the tokenizer")
            self._pending += 1
        future = self._executor.submit(self._call, fn, args)
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
