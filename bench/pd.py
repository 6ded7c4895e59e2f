"""Prefill/decode disaggregation through the third tier against one colocated vLLM instance; same as ``hicache bench pd``."""

from hicache.cli.benchmarks.pd import main

if __name__ == "__main__":
    raise SystemExit(main())
