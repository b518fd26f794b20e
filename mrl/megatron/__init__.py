"""megatron-core adapter: CPU compat, parallel setup, model building.

Import ``mrl.megatron.compat`` before anything from ``megatron.core`` (``mrl.megatron.mcore`` does it).
"""
