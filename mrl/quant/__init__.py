"""Weight quantization for rollout engines: block-wise FP8 (``fp8``: the quantizer, which HF tensors it
applies to, and the export of a block-FP8 Hugging Face checkpoint)."""
