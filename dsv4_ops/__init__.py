"""dsv4_ops: DeepSeek-V4 / V4.1 sparse-MLA decode kernels for NVIDIA Ampere (sm_80 / sm_86).

Importing the package registers ``torch.ops.dsv4_ampere.*`` once per process; this is the
only place that does.
"""

__version__ = "0.1.0"

from .registration import register_all  # noqa: E402

register_all()

from .support import is_supported  # noqa: E402

__all__ = ["__version__", "is_supported", "register_all"]
