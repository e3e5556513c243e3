"""Test-only vLLM platform plugin: the CUDA platform answering as an A100 (see plugin.py)."""
