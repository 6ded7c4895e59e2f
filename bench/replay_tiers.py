"""Host tier in replay: hit ratio and req/s vs device-only; same as ``hicache bench tiers``."""

from hicache.cli.benchmarks.tiers import main

if __name__ == "__main__":
    raise SystemExit(main())
