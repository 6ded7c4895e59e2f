"""vLLM's OpenAI server with and without hicache under many multi-turn clients; same as ``hicache bench serve``."""

from hicache.cli.benchmarks.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
