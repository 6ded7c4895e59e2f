"""The harness around the library: a reference model and engine, traces, replay, stress, checks.

``modelconfig`` (shapes, presets), ``model`` (the reference decoder), ``costmodel``
(analytic recompute/reload costs), ``engine`` (the request loop over model + cache),
``kvcheck`` (verifiable KV), ``traces`` (the trace format) and ``workloads`` (its
generators), ``replay`` (bookkeeping-only replays), ``faults`` and ``stress`` (fault
injection and the stress run). Library-like code only: the command line around it is
:mod:`hicache.cli`, which imports from here, never the other way round. Nothing in the
library imports from here either.
"""
