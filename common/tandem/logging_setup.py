"""structlog configuration: JSON lines to stderr, or a readable console format for people."""

from __future__ import annotations

import logging
import sys

import structlog


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
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
