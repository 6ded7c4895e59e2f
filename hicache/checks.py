"""Argument checks shared by every part of hicache: one function per kind of value.

Each returns the checked value (normalised where that is cheap: numpy integers become
``int``) or raises one error that names the argument, what was expected and what it
got: ``TypeError`` for a value of the wrong type (including a tensor's dtype),
``ValueError`` for a value of the right type outside what is allowed (a tensor's
shape, device or contents, a number out of range). Nothing here knows the cache.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Sequence
from enum import Enum
from typing import Any, TypeVar

import numpy as np
import torch

INTEGERS = (int, np.integer)

E = TypeVar("E", bound=Enum)

MIN_PRIORITY, MAX_PRIORITY = -(2**62), 2**62  # inside C++'s int64 with room to negate


def _named(name: str, text: str) -> str:
    """``"name: text"``; ``text`` alone for an unnamed value (argparse names it)."""
    return f"{name}: {text}" if name else text


def _plain(x: float) -> str:
    """A bound as written: ``4294967296``, not ``4.29497e+09``; ``0.5`` as is."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _got(value: object, show_value: bool) -> str:
    return repr(value) if show_value else type(value).__name__


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None, *,
              what: str = "int", show_value: bool = False) -> int:
    """``value`` as an int >= ``minimum`` and, if given, < ``maximum`` (Python or numpy
    integer, never a bool). The TypeError says ``expected <what>, got`` the value's
    type, or with ``show_value`` its repr (for values read from text, where the value
    says more than its type)."""
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, INTEGERS)):
        raise TypeError(_named(name, f"expected {what}, got {_got(value, show_value)}"))
    return int(check_bounds(name, int(value), minimum=minimum, maximum=maximum))


def check_number(name: str, value: object, *, what: str = "a number",
                 show_value: bool = False) -> float:
    """``value`` if it is an int or a float (never a bool); else a TypeError saying
    ``expected <what>, got`` its type (or, with ``show_value``, its repr)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(_named(name, f"expected {what}, got {_got(value, show_value)}"))
    return value


def check_finite(name: str, value: float, *, shown: str | None = None) -> float:
    """``value`` if it is neither NaN nor infinite (``shown``: how the message shows it)."""
    if not math.isfinite(value):
        raise ValueError(_named(name, f"expected a finite number, got "
                                      f"{value if shown is None else shown}"))
    return value


def check_bounds(name: str, value: float, *, minimum: float | None = None, strict: bool = False,
                 maximum: float | None = None, max_included: bool = False, what: str = "",
                 shown: str | None = None) -> float:
    """``value`` if it is ``>= minimum`` (``> minimum`` when ``strict``) and ``< maximum``
    (``<= maximum`` when ``max_included``); None is no bound. The ValueError reads
    ``name: expected [what ]>= minimum, got value``, the bound written as a plain
    number, the value as ``shown`` if given (the user's text)."""
    got = value if shown is None else shown
    prefix = f"{what} " if what else ""
    if minimum is not None and not (value > minimum if strict else value >= minimum):
        raise ValueError(_named(name, f"expected {prefix}{'>' if strict else '>='} "
                                      f"{_plain(minimum)}, got {got}"))
    if maximum is not None and not (value <= maximum if max_included else value < maximum):
        raise ValueError(_named(name, f"expected {prefix}{'<=' if max_included else '<'} "
                                      f"{_plain(maximum)}, got {got}"))
    return value


def check_choice(name: str, value: object, allowed: Sequence[object]) -> object:
    """``value`` if it is one of ``allowed``; the ValueError lists them."""
    if value not in allowed:
        raise ValueError(_named(name, f"expected one of {list(allowed)}, got {value!r}"))
    return value


def check_enum(cls: type[E], name: str, value: object) -> E:
    """``value`` as a member of the Enum ``cls`` (a member or its value); the ValueError
    lists the values."""
    try:
        return cls(value)
    except ValueError:
        check_choice(name, value, [m.value for m in cls])
        raise


def check_device(device: object, name: str = "device") -> str:
    """``device`` if it is ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (whether it exists here is
    :func:`hicache.memory.pools.check_device_available`'s question)."""
    if not isinstance(device, str):
        raise TypeError(_named(name, f"expected str, got {type(device).__name__}"))
    if device in ("cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(_named(name, f"expected 'cpu', 'cuda' or 'cuda:N', got {device!r}"))


_TEXT_KINDS = {int: "an integer", float: "a number", dict: "JSON", list: "a list of ints"}


def parse_text(name: str, text: str, kind: type) -> Any:
    """``text`` (an environment variable, a command-line option) parsed as ``kind``:
    bool (``1/true/yes/on``, ``0/false/no/off``), int, float (``_`` separators allowed),
    dict (JSON) or list (of ints: JSON or comma-separated). The ValueError reads
    ``name: expected an integer, got '<text>'``; range checks are the caller's."""
    value = text.strip()
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(_named(name, f"expected true or false, got {text!r}"))
    if kind not in _TEXT_KINDS:
        raise TypeError(_named(name, f"no parser for {kind}"))
    try:
        if kind is int:
            return int(value.replace("_", ""))
        if kind is float:
            return float(value.replace("_", ""))
        if kind is dict or value.startswith("["):
            return json.loads(value)
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise ValueError(_named(name, f"expected {_TEXT_KINDS[kind]}, got {text!r}")) from None


def check_priority(priority: object) -> int:
    """``priority`` as an eviction priority: an int in [-2**62, 2**62]."""
    if isinstance(priority, bool) or not isinstance(priority, INTEGERS):
        raise TypeError(f"priority: expected int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority: expected an int in [-2**62, 2**62], got {priority}")
    return int(priority)


def check_namespace(namespace: object) -> None:
    """A namespace is a str or None."""
    check_optional_str("namespace", namespace)


def check_optional_str(name: str, value: object) -> str | None:
    """``value`` as a str or None."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name}: expected str or None, got {type(value).__name__}")
    return value


def check_page_tensor(name: str, page_ids: object) -> torch.Tensor:
    """``page_ids`` in the form page ids take everywhere: a 1-D int64 CPU tensor."""
    if not isinstance(page_ids, torch.Tensor):
        raise TypeError(f"{name}: expected an int64 torch.Tensor, got {type(page_ids).__name__}")
    if page_ids.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {page_ids.dtype}")
    if page_ids.layout is not torch.strided:
        raise ValueError(f"{name}: expected a dense tensor, got layout {page_ids.layout}")
    if page_ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(page_ids.shape)}")
    if not page_ids.is_cpu:
        raise ValueError(f"{name}: expected a CPU tensor, got device {page_ids.device}")
    return page_ids


def check_page_count(name: str, page_ids: object, num_pages: int) -> torch.Tensor:
    """:func:`check_page_tensor`, and exactly ``num_pages`` ids (one per whole page)."""
    page_ids = check_page_tensor(name, page_ids)
    if page_ids.shape[0] != num_pages:
        raise ValueError(
            f"{name}: expected one page id per whole page ({num_pages}), got {page_ids.shape[0]}"
        )
    return page_ids


def check_page_ids(name: str, page_ids: object, num_pages: int) -> torch.Tensor:
    """:func:`check_page_tensor`, and each id in ``[0, num_pages)`` (a pool's range)."""
    page_ids = check_page_tensor(name, page_ids)
    if page_ids.numel():
        # One reduction for both bounds: this runs on every transfer submission.
        lo_t, hi_t = page_ids.aminmax()
        lo, hi = lo_t.item(), hi_t.item()
        if lo < 0 or hi >= num_pages:
            raise ValueError(
                f"{name}: expected ids in [0, {num_pages}), got min {lo}, max {hi}"
            )
    return page_ids


def check_bool(name: str, value: object) -> bool:
    """``value`` as a bool (only ``True`` or ``False``: no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise TypeError(_named(name, f"expected bool, got {type(value).__name__}"))
    return value


def check_timeout(name: str, timeout: object) -> float | None:
    """``timeout`` as seconds to wait, >= 0, or None (no limit; infinity also means none)."""
    if timeout is None:
        return None
    timeout = check_number(name, timeout, what="seconds or None")
    if not timeout >= 0:  # also refuses NaN
        raise ValueError(_named(name, f"expected >= 0, got {timeout}"))
    return None if math.isinf(timeout) else timeout


def check_ttl(name: str, ttl_s: object) -> float:
    """``ttl_s`` as a time-to-live in seconds: a finite number > 0, or None (``math.inf``)."""
    if ttl_s is None:
        return math.inf
    return check_positive_number(name, ttl_s, what="a number of seconds or None")


def check_positive_number(name: str, value: object, *, what: str = "a number") -> float:
    """``value`` as a finite number > 0 (an int or float, never a bool; NaN refused).

    ``what`` names the expected type in the TypeError (``"a number of seconds or None"``).
    """
    value = check_number(name, value, what=what)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(_named(name, f"expected a finite number > 0, got {value}"))
    return float(value)


def check_seconds(name: str, value: object) -> float:
    """``value`` as a duration: a finite number of seconds >= 0."""
    value = check_number(name, value, what="seconds")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(_named(name, f"expected a finite number >= 0, got {value}"))
    return float(value)


def check_fraction(name: str, value: object) -> float:
    """``value`` as a fraction: a number in [0, 1]."""
    value = check_number(name, value, what="a number")
    if not 0 <= value <= 1:
        raise ValueError(_named(name, f"expected a fraction in [0, 1], got {value}"))
    return float(value)


def check_model_id(model_id: object) -> str:
    """Return ``model_id`` if it is a non-empty str, else raise naming what was expected."""
    if not isinstance(model_id, str):
        raise TypeError(
            f"model_id: expected a non-empty str naming the model (see "
            f"hicache.storage.model_identity), got {type(model_id).__name__}"
        )
    if not model_id.strip():
        raise ValueError(
            f"model_id: expected a non-empty str naming the model (see "
            f"hicache.storage.model_identity), got {model_id!r}"
        )
    return model_id


def check_secret(name: str, secret: object) -> str | bytes | None:
    """Return ``secret`` if it is None or a non-empty str/bytes; the error never shows it."""
    if secret is None:
        return None
    if not isinstance(secret, str | bytes):
        raise TypeError(f"{name}: expected a non-empty str or bytes, got {type(secret).__name__}")
    if not secret:
        raise ValueError(f"{name}: expected a non-empty str or bytes, got an empty one")
    return secret


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80


def show(value: object) -> str:
    """``value`` for an error message: short (nested or huge values cut), ASCII (a lone
    surrogate is escaped), and never raising (an int of 5,000 digits' ``repr`` does)."""
    try:
        return ascii(_SHOW.repr(value))[1:-1]
    except Exception:
        return f"<{type(value).__name__}>"
