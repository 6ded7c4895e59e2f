"""What both halves of the connector share: options, per-request control, the step plan,
the storage identity and keys, tensor parallelism. Imports no vLLM.
"""
