"""A logging handler as a logging integration sees records (Sentry's is one): it writes
each record's level, logger and whether it carries exc_info to a JSON-lines file, so a
test can read what a child process handed to its handlers."""

from __future__ import annotations

import json
import logging


class RecordFile(logging.Handler):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        exc_type = record.exc_info[0] if record.exc_info else None
        line = {"level": record.levelname, "logger": record.name, "message": record.getMessage(),
                "exc_type": exc_type.__name__ if exc_type else None,
                "traceback": self.formatter.formatException(record.exc_info)
                if record.exc_info and self.formatter else None}
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")
