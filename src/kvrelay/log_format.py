"""Logging set-up shared by every role: `--log-level` and `--log-format text|json`.

JSON lines carry `ts`, `level`, `logger`, `message`, and any structured fields a record was given
with `extra={"fields": {...}}` (the gateway's access lines, the engine's stats lines) as keys of
their own, so a log pipeline reads them without parsing the message.
"""

from __future__ import annotations

import json
import logging
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def add_log_arguments(parser, with_level: bool = True) -> None:
    if with_level:
        parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="json: one JSON object per line, access and stats lines with their fields as keys")
