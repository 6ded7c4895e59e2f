"""Adapters that plug hicache into inference engines (see :mod:`hicache.integrations.vllm`)."""
