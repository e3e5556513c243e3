"""torch.library registration of the ``dsv4_ampere`` namespace, and the vLLM plugin.

``register_all()`` defines every op once; calling it again is harmless.
"""

from .library import NAMESPACE, define_op, op_exists


def register_all() -> None:
    """Define every dsv4_ampere op in this process (idempotent)."""
    from . import attention_ops, codec_ops
    from . import kv_cache_ops

    codec_ops.register()
    attention_ops.register()
    kv_cache_ops.register()


__all__ = ["NAMESPACE", "define_op", "op_exists", "register_all"]
