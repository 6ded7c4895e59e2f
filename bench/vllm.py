"""vLLM alone vs with the hicache connector; same as `hicache bench vllm` (see hicache/cli/benchmarks).

This file is named like the package it measures: run as a script, its directory
comes first on ``sys.path`` and ``import vllm`` would find this file. It takes its
directory off the path before anything imports vLLM.
"""

from __future__ import annotations

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

from hicache.cli.benchmarks.vllm import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
