"""Third-tier write/read throughput with and without a storage secret; same as ``hicache bench storage``."""

from hicache.cli.benchmarks.storage import main

if __name__ == "__main__":
    raise SystemExit(main())
