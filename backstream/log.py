"""The package's one logger: `log.info(...)` prints "backstream: ...", `log.warning(...)` "backstream:
warning: ...", `log.error(...)` "backstream: error: ..." on stderr; under torchrun from rank 0 only,
unless a record says `extra={"every_rank": True}` (a rank's own failure). It writes to the stderr of
the moment, so that a redirected or captured stderr gets it. A leaf: it imports nothing of the package."""

from __future__ import annotations

import logging
import os
import sys

PREFIX = {logging.WARNING: "backstream: warning: ", logging.ERROR: "backstream: error: "}


class _CurrentStderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record is emitted."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return PREFIX.get(record.levelno, "backstream: ") + record.getMessage()


def _rank0(record: logging.LogRecord) -> bool:
    return getattr(record, "every_rank", False) or os.environ.get("RANK", "0") == "0"


log = logging.getLogger("backstream")
if not log.handlers:
    _handler = _CurrentStderr()
    _handler.setFormatter(_Format())
    _handler.addFilter(_rank0)
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False
