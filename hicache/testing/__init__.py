"""Helpers for tests, benchmarks and demos; the library never imports from here.

:mod:`.mooncake_master` starts a loopback Mooncake cluster (processes only). These
modules ship with the package so that the installed CLI (``hicache bench storage``)
and one-machine setups (docs/storage.md) can use them, but nothing under
``hicache/`` outside :mod:`hicache.cli` and this package depends on them.
"""
