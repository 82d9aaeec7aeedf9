"""How every process of the pool logs: one level and one format, chosen once by the operator.

`laya-pool --log-level L --log-format text|json` sets $LAYA_POOL_LOG and $LAYA_POOL_LOG_FORMAT, which the
broker and the worker processes inherit from the supervisor, so the whole pool writes one kind of line to
the same stderr. `json` writes one object per line (`ts`, `level`, `logger`, `process`, `msg`, and the
`request` id when a line is about a request), for log shippers that parse JSON.

Here, in the protocol package, because the broker, the worker and the CLI all set up logging and may all
import it (pure stdlib).
"""
from __future__ import annotations

import json
import logging
import sys
import time

from . import settings

LEVEL_ENV = "LAYA_POOL_LOG"
FORMAT_ENV = "LAYA_POOL_LOG_FORMAT"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")


def check_level(level: str) -> str:
    """The level in upper case, or ValueError naming the choices."""
    up = str(level).strip().upper()
    if up not in LEVELS:
        raise ValueError(f"unknown log level {level!r} (one of {', '.join(x.lower() for x in LEVELS)})")
    return up


def check_format(fmt: str) -> str:
    low = str(fmt).strip().lower()
    if low not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (text or json)")
    return low


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the process name (`broker`, `worker 0`, `supervisor`) in `process`."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "process": self.process, "pid": record.process,
               "msg": record.getMessage()}
        request = getattr(record, "request", None)
        if request is not None:
            out["request"] = request
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(process: str, level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger on stderr. `level` / `fmt` None: from the environment, else INFO / text.
    An unusable value from the environment falls back to the default (a child must not die of it: the CLI
    checks the flags before it exports them)."""
    try:
        level = check_level(level or settings.raw(LEVEL_ENV) or "INFO")
    except ValueError:
        level = "INFO"
    try:
        fmt = check_format(fmt or settings.raw(FORMAT_ENV) or "text")
    except ValueError:
        fmt = "text"
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {process} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
