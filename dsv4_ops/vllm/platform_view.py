"""vLLM's ``current_platform`` answering as another GPU for a block, for code that asks it
questions (selection code, batch defaults) on a host that is not that GPU.

``answering(name=value, ...)`` sets the attributes on the platform instance (methods as
plain callables) and restores what was there, or removes what was not, afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator


@contextlib.contextmanager
def answering(**attrs: Any) -> Iterator[Any]:
    """Yields ``current_platform`` with ``attrs`` set on the instance for the block."""
    from vllm.platforms import current_platform as cp

    saved = {k: cp.__dict__[k] for k in attrs if k in cp.__dict__}
    for k, v in attrs.items():
        setattr(cp, k, v)
    try:
        yield cp
    finally:
        for k in attrs:
            if k in saved:
                setattr(cp, k, saved[k])
            else:
                cp.__dict__.pop(k, None)
