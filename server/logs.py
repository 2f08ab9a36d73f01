"""The server's log: one line per event on stderr, logfmt (key=value) or JSON.

configure_logging installs the one handler on the root logger and quiets what is not the
operator's business: jax's platform probing ("Unable to initialize backend 'tpu'") and its
cache bookkeeping ("Resetting cache at <empty>") go below the log level, as does the engine's
own cache-directory line, because the server's "serving" line states the directory once.
Warnings from those loggers still get through.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# Loggers whose INFO lines are start-up noise in a server's log (their warnings are kept).
QUIET_LOGGERS = (
    "jax._src.xla_bridge",  # "Unable to initialize backend 'tpu': ... libtpu.so"
    "jax._src.compilation_cache",  # "Resetting cache at <empty>."
    "jpaged.worker.compilation_cache",  # the cache directory: the "serving" line states it
)


def configure_logging(level: str = "INFO", fmt: str = "logfmt") -> None:
    """Call before jax initialises its backends (before the engine is built)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet = max(root.level, logging.WARNING)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(quiet)


def _record_fields(record: logging.LogRecord) -> dict:
    fields = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    fields.update(getattr(record, "fields", {}))
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    return fields


class LogfmtFormatter(logging.Formatter):
    """key=value lines; the `fields` dict passed as `extra` becomes keys (e.g. request_id)."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _record_fields(record).items():
            text = "" if value is None else str(value)
            if not text or any(ch in text for ch in ' ="\n'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_record_fields(record), default=str)
