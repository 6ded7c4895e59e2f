"""The C++ extension: its sources (``csrc/``), its install-time build and its JIT fallback."""
