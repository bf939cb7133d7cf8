"""The "bagf_torch" logger, configured lazily on first use (never at import), and once-per-reason logging."""

from __future__ import annotations

import logging
import sys
import threading

from . import settings

_LOGGER = logging.getLogger("bagf_torch")
_lock = threading.Lock()
_configured = False
_said: set[str] = set()


def logger() -> logging.Logger:
    """The package logger, with BAGF_LOG applied. A stderr handler is added only when the application has
    configured no logging at all, so INFO lines asked for with BAGF_LOG=info are visible."""
    global _configured
    if not _configured:
        bad = None
        with _lock:
            if not _configured:
                try:
                    level = settings.log_level()
                except settings.SettingError as e:  # a bad BAGF_LOG must not break the forward that logs
                    level, bad = logging.WARNING, e
                _LOGGER.setLevel(level)
                if not _LOGGER.handlers and not logging.getLogger().handlers:
                    handler = logging.StreamHandler(sys.stderr)
                    handler.setFormatter(logging.Formatter("[bagf_torch] %(levelname)s %(message)s"))
                    _LOGGER.addHandler(handler)
                    _LOGGER.propagate = False
                _configured = True
        if bad is not None:
            _LOGGER.warning(f"{bad}; logging at 'warning'")
    return _LOGGER


def once(reason: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``reason`` is seen in this process."""
    with _lock:
        if reason in _said:
            return
        _said.add(reason)
    logger().log(level, message)


def reset() -> None:
    """Forget which reasons were logged and re-read BAGF_LOG (tests)."""
    global _configured
    with _lock:
        _said.clear()
        _configured = False
