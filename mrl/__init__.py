"""mrl: Megatron-backed, MoE-first asynchronous RL post-training with SGLang rollouts."""

__version__ = "0.1.0"
