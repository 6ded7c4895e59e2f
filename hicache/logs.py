"""Logging: the ``hicache`` logger hierarchy and the ``HICACHE_LOG_LEVEL`` switch.

Every module logs to ``logging.getLogger(__name__)`` (``hicache.native.build``,
``hicache.transfer``, ...), under the ``hicache`` logger. A library does not
decide where its records go: ``hicache`` carries a ``NullHandler``, so nothing is
printed unless the application configures logging, or ``HICACHE_LOG_LEVEL``
(``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) asks for records on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping

LOGGER_NAME = "hicache"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_handler: logging.Handler | None = None


def configure_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Apply ``HICACHE_LOG_LEVEL``: records of that level and above go to stderr.

    Idempotent; an unknown level is ignored with a warning (a typo in an
    environment variable should not stop an import).
    """
    global _handler
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    value = (os.environ if environ is None else environ).get("HICACHE_LOG_LEVEL")
    if value is None:
        return
    level = value.strip().upper()
    if level not in _LEVELS:
        warnings.warn(f"HICACHE_LOG_LEVEL: expected one of {', '.join(_LEVELS)}, got {value!r}",
                      RuntimeWarning, stacklevel=2)
        return
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(_handler)
    _handler.setLevel(level)
    logger.setLevel(level)
