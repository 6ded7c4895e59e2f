"""The connector's own time: how long vLLM's calls into the connector take, per hook.

Decorators for :class:`~hicache.integrations.vllm.connector.HiCacheConnector`'s hooks.
A worker-side hook's time goes to the worker half's ``hook_seconds`` (the connector's
share of vLLM's step on the worker, copies made there included) and, per hook, to the
connector's worker-side :class:`HookClock`; a scheduler-side hook's to the scheduler
half's clock (lookups, plans, request ends), per hook too.

:class:`HookClock` sums, per hook name, the wall and CPU seconds and the calls of the
timed hooks. On the worker side it also times what vLLM does between them. vLLM 0.32's
model runner calls, in one step::

    handle_preemptions | input prep | start_load_kv | forward .............. | wait_for_save
                       |<------------------- model ------------------------>|
                                                    |<--- load_forward ---->|
                                    a sync load is copied here, layer by layer, on the
                                    copy thread; wait_for_layer_load(i) waits for layer i

(in a step without a sync load vLLM calls ``start_load_kv`` after the forward, just
before ``wait_for_save``). ``model`` is timed in every step, ``load_forward`` in the
steps that start a load: the loads' copy time (``load_seconds``) set against the
forward they ran under, and the part of it the forward waited for (the
``wait_for_layer_load`` hook), say how much of the loads is hidden.

Reported as flat keys, summed like the connector's other counters::

    <prefix>hook_seconds.<hook>, <prefix>hook_cpu_seconds.<hook>, <prefix>hook_calls.<hook>
    model_seconds, model_steps, load_forward_seconds, load_forward_steps  (worker side)

This module knows hook names and clocks; nothing of vLLM, requests or copies.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Hook = Callable[Concatenate[Any, _P], _R]
_Add = Callable[[Any, str, float, float, float], None]


def _clocked(add: _Add) -> Callable[[_Hook[_P, _R]], _Hook[_P, _R]]:
    """A hook decorator: each call goes to ``add(connector, hook, start, end, cpu)``,
    ``hook`` the method's name without leading underscores, ``start``/``end``
    ``time.perf_counter`` and ``cpu`` this thread's CPU seconds. Wall time includes
    waits for a core, and for copies of other threads; CPU time is what the hook itself
    took from its core."""

    def decorate(hook: _Hook[_P, _R]) -> _Hook[_P, _R]:
        name = hook.__name__.lstrip("_")

        @functools.wraps(hook)
        def timed(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return hook(self, *args, **kwargs)
            finally:
                add(self, name, start, time.perf_counter(), time.thread_time() - start_cpu)

        return timed

    return decorate


def _add_worker_seconds(self: Any, hook: str, start: float, end: float, cpu: float) -> None:
    if self.worker_half is not None:
        self.worker_half.counters.hook_seconds += end - start
        self.worker_half.counters.hook_cpu_seconds += cpu
        self._worker_clock.add(hook, start, end, cpu, loading=self.worker_half.loading)


def _add_scheduler_seconds(self: Any, hook: str, start: float, end: float,
                           cpu: float) -> None:
    self._scheduler_report.add_seconds(end - start, cpu, hook)


timed_worker_hook = _clocked(_add_worker_seconds)
timed_scheduler_hook = _clocked(_add_scheduler_seconds)


# The hooks that bracket the model runner's work on the worker (see the diagram above).
STEP_START_HOOK = "handle_preemptions"
LOAD_START_HOOK = "start_load_kv"
STEP_END_HOOK = "wait_for_save"


class HookClock:
    """Per-hook wall seconds, CPU seconds and calls since the last :meth:`take`.

    ``prefix``: put before every key (``"scheduler_"`` for the scheduler side, so that
    the two sides' keys stay apart once vLLM merges the reports).
    """

    def __init__(self, prefix: str = "") -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
        self.prefix = prefix
        self._seconds: dict[str, float] = {}
        self._cpu_seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        # the model runner's work (worker side): since STEP_START_HOOK returned, and
        # since LOAD_START_HOOK returned having started a load (None: not in this step)
        self._model_from: float | None = None
        self._load_from: float | None = None
        self.model_seconds = 0.0
        self.model_steps = 0
        self.load_forward_seconds = 0.0
        self.load_forward_steps = 0
        self.last_model_seconds: float | None = None  # the model runner's in the last step

    def add(self, hook: str, start: float, end: float, cpu_seconds: float,
            *, loading: bool = False) -> None:
        """One call of ``hook`` from ``start`` to ``end`` (``time.perf_counter``) that
        used ``cpu_seconds`` of its thread. ``loading`` (with ``start_load_kv``): it
        started a load, so the step's forward from its return counts as a load's."""
        self._seconds[hook] = self._seconds.get(hook, 0.0) + (end - start)
        self._cpu_seconds[hook] = self._cpu_seconds.get(hook, 0.0) + cpu_seconds
        self._calls[hook] = self._calls.get(hook, 0) + 1
        if hook == STEP_START_HOOK:
            self._model_from, self._load_from = end, None
        elif hook == LOAD_START_HOOK and loading:
            self._load_from = end
        elif hook == STEP_END_HOOK:
            self.last_model_seconds = None
            if self._model_from is not None:
                self.last_model_seconds = start - self._model_from
                self.model_seconds += self.last_model_seconds
                self.model_steps += 1
            if self._load_from is not None:
                self.load_forward_seconds += start - self._load_from
                self.load_forward_steps += 1
            self._model_from = self._load_from = None

    def take(self) -> dict[str, float | int]:
        """Everything since the last call, as flat stats keys; then starts from zero
        (a step being timed keeps its start)."""
        p = self.prefix
        out: dict[str, float | int] = {}
        for hook, seconds in self._seconds.items():
            out[f"{p}hook_seconds.{hook}"] = seconds
            out[f"{p}hook_cpu_seconds.{hook}"] = self._cpu_seconds[hook]
            out[f"{p}hook_calls.{hook}"] = self._calls[hook]
        if self.model_steps:
            out.update({f"{p}model_seconds": self.model_seconds,
                        f"{p}model_steps": self.model_steps,
                        f"{p}load_forward_seconds": self.load_forward_seconds,
                        f"{p}load_forward_steps": self.load_forward_steps})
        self._seconds, self._cpu_seconds, self._calls = {}, {}, {}
        self.model_seconds = self.load_forward_seconds = 0.0
        self.model_steps = self.load_forward_steps = 0
        return out


def per_hook(data: dict, prefix: str = "", kind: str = "seconds") -> dict[str, float]:
    """``{hook: value}`` of the ``<prefix>hook_<kind>.<hook>`` keys of a stats dict
    (``kind``: ``seconds``, ``cpu_seconds`` or ``calls``)."""
    if kind not in ("seconds", "cpu_seconds", "calls"):
        raise ValueError(f"kind: expected 'seconds', 'cpu_seconds' or 'calls', got {kind!r}")
    head = f"{prefix}hook_{kind}."
    return {key[len(head):]: value for key, value in data.items()
            if isinstance(key, str) and key.startswith(head)}
