"""structlog configuration: JSON lines to stderr, or a readable console format for people."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """`sys.stderr` as it is at each write, not at configuration (a redirected or replaced stderr,
    such as a test runner's capture, must not leave loggers holding a closed stream)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", json: bool = True) -> None:
    """Configures structlog and the standard library's root logger once per process."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # One write per record (message and newline together): the processes of `tandem serve`
        # share stderr, and print()'s two writes let their records run into one line.
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
