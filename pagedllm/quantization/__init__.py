"""Weights kept quantized: GGUF blocks as they are, and int8/int4 for Hugging Face checkpoints."""
