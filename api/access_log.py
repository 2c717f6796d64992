"""The API server's logging: kiln's one configuration (`common.logs`) with `RedactSecrets` on its
handlers, so no line, uvicorn's access log included, carries an API key or a signing secret,
whatever a client put in its URL.

The API takes keys only from the ``Authorization`` header; a client that puts one in a query
string anyway (an old dashboard, a hand-written ``curl``) is refused, and the line that records
the refusal must not be where the key ends up.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from common import logs

# A kiln API key (storage.users: "kiln_", a 12-character prefix, the secret part). The prefix
# is kept (it names the key in `kiln keys list`), the rest is not.
_API_KEY = re.compile(r"\b(kiln_[a-z0-9]{12})[A-Za-z0-9]{8,}")
# A webhook signing secret in the Standard Webhooks form.
_WHSEC = re.compile(r"\bwhsec_[A-Za-z0-9+/=%]+")
# Query parameters whose value is a credential by its name, whatever its form.
_SECRET_PARAM = re.compile(
    r"([?&;](?:key|api_key|apikey|access_token|token|secret|signature|sig|password)=)[^&;#\s]*",
    re.IGNORECASE)
REDACTED = "[redacted]"


def redact(text: str) -> str:
    """``text`` with API keys, signing secrets and credential-named query values replaced."""
    text = _SECRET_PARAM.sub(rf"\g<1>{REDACTED}", text)
    text = _API_KEY.sub(rf"\g<1>{REDACTED}", text)
    return _WHSEC.sub(f"whsec_{REDACTED}", text)


class RedactSecrets(logging.Filter):
    """Redacts a record's message and string arguments in place (uvicorn's access formatter
    reads the arguments by position, so their number and order stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v
                           for k, v in record.args.items()}
        return True


def log_config(level: str = "INFO", fmt: str = "text") -> dict[str, Any]:
    """The API server's logging (`common.logs.config`: kiln's lines and uvicorn's, access log
    included, through one handler) with `RedactSecrets` on every handler."""
    config = logs.config(level, fmt, process="api")
    config["filters"] = {"redact_secrets": {"()": RedactSecrets}}
    for handler in config["handlers"].values():
        handler["filters"] = ["redact_secrets"]
    return config
