"""The connector's scheduler half (vLLM's scheduler process): lookups, the step plan,
write policies, third-tier promises and prefetch, KV events. :mod:`.half` holds
:class:`~hicache.integrations.vllm.scheduler.half.SchedulerHalf`; only :mod:`.kv_events`
imports vLLM.
"""
