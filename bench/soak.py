"""vLLM's OpenAI server with hicache under steady load, its third tier failing; same as ``hicache bench soak``."""

from hicache.cli.benchmarks.serve_soak import main

if __name__ == "__main__":
    raise SystemExit(main())
