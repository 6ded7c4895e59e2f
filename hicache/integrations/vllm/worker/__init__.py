"""The connector's worker half (each vLLM worker process): block <-> host page copies,
third-tier reads and writes, wrong-KV tracking. :mod:`.half` holds
:class:`~hicache.integrations.vllm.worker.half.WorkerHalf`. Imports no vLLM.
"""
