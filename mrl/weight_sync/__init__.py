"""Resharding weight sync: Megatron (TP/PP/EP/ETP) -> SGLang engines, in planned, streamed buckets."""
