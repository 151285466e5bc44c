"""A logging handler that keeps what it is given, for the tests that read
the plugin's log lines."""

from __future__ import annotations

import logging


class KeptRecords(logging.Handler):
    """Keeps every record, at every level, in :attr:`records`."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
