"""Who a vLLM engine's KV belongs to: what third-tier keys are salted with.

Two vLLM instances share stored pages only when their KV layout and their model
agree (see :func:`storage_identity`). This module reads vLLM's configs, nothing
else of vLLM.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

from hicache.integrations.vllm.common.config import ConnectorConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def device_type(vllm_config: VllmConfig) -> str:
    """vLLM's device kind (``cpu``, ``cuda``, ...)."""
    return str(vllm_config.device_config.device_type)


def layout_planes(vllm_config: VllmConfig) -> int:
    """:func:`block_planes` of vLLM's device."""
    return block_planes(device_type(vllm_config))


def block_planes(device: str) -> int:
    """Planes per layer of a block in the KV layout the connector copies on ``device``:
    one on vLLM's CPU backend (K and V fused, ``(num_blocks, H, block_size, 2 * D)``),
    two elsewhere (split K/V, ``(2, num_blocks, block_size, H, D)``)."""
    return 1 if device == "cpu" else 2


def storage_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                     config: ConnectorConfig) -> tuple[str, str]:
    """What third-tier keys are salted with: ``(KV layout fingerprint, model_id)``.

    Two vLLM instances share stored pages only when both are equal: same device kind,
    KV dtype, shape and tensor layout (vLLM's resolved ``kv_cache_layout`` and the
    planes of :func:`block_planes`, which the workers check at start-up), block size,
    and same model — ``model_id`` from the extra config when given
    (the deliberate way to share), else one derived from vLLM's model config: the model
    (path or name) with its revision, or for a local directory without a revision a
    digest of its files' names, sizes and modification times (weights changed in place
    give new keys), the compute dtype and the tensor-parallel size.
    """
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    layout = (
        f"vllm-{type(spec).__name__}-L{layers}-H{getattr(spec, 'num_kv_heads', '?')}"
        f"-D{getattr(spec, 'head_size', '?')}-{str(getattr(spec, 'dtype', '?')).removeprefix('torch.')}"
        f"-B{spec.block_size}-bytes{spec.page_size_bytes}"
        f"-{device_type(vllm_config)}-planes{block_planes(device_type(vllm_config))}"
        f"-{getattr(kv_cache_config, 'kv_cache_layout', None) or 'default'}"
    )
    if config.model_id is not None:
        return layout, config.model_id
    from hicache.storage import model_identity

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    revision = mc.revision
    digest = None
    if revision is None:
        digest = _directory_digest(str(mc.model)) if os.path.isdir(str(mc.model)) else None
        if digest is None:
            revision = "main"  # a hub name without a pinned revision: vLLM loads main
    model_id = model_identity(
        str(mc.model), weights_digest=digest, revision=revision, dtype=str(mc.dtype),
        tp_size=pc.tensor_parallel_size,  # each rank's worker salts its own keys further
    )
    return layout, model_id


def _directory_digest(path: str) -> str:
    """sha256 over (relative name, size, mtime) of every file under ``path``: a cheap
    stand-in for hashing the weights that changes whenever a file is replaced."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            h.update(f"{os.path.relpath(full, path)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def page_nbytes(kv_cache_config: KVCacheConfig) -> int:
    group = kv_cache_config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)
