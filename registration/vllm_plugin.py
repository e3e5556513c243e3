"""vLLM general-plugin entry point (``vllm.general_plugins``: ``dsv4_ops``).

vLLM calls ``register()`` in every process (API server, engine core, each worker) before the
model is built. The logic, the patch table and the replacements live in ``dsv4_ops.vllm``.
"""

from dsv4_ops.vllm.plugin import UnauditedServePathError, VllmPatchError, register  # noqa: F401

__all__ = ["UnauditedServePathError", "VllmPatchError", "register"]
