"""Run a uvicorn server until SIGTERM / SIGINT and return normally (exit 0) once it has drained.

Shared by `deepserve serve` and `deepserve router`; light (no fastapi, no engine).
"""

from __future__ import annotations

import logging
import signal

logger = logging.getLogger(__name__)


def run_until_signal(server) -> None:
    """Run uvicorn; after a SIGTERM / SIGINT it drains and returns, and then this returns too (exit 0).

    uvicorn re-raises the signal it caught once it has shut down, to the handler that was in place before
    it started; a no-op handler here turns that into a normal return instead of death by signal.
    """
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, _note_signal) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note_signal(signum: int, _frame) -> None:
    logger.warning("received %s: drained and stopped", signal.Signals(signum).name)
