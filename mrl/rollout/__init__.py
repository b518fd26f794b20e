"""Rollouts from real SGLang engines: launcher (CPU mode and GPUs), async client, rollout manager."""
