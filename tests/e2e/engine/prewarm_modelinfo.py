"""Fill vLLM's model-info cache (``$VLLM_CACHE_ROOT/modelinfos``) for the e2e model classes in
one process, as vLLM's registry would in a fresh subprocess per architecture and per engine
start on a machine without the cache (about 20 s each on the device). The entries carry the
module's hash, so vLLM uses them only while dsv4_e2e_a100/models.py is unchanged.

    DSV4_E2E_A100=1 python tests/e2e/engine/prewarm_modelinfo.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# the targets, then the draft models the speculative runs build (DSpark for V4.1, MTP for V4)
ARCHS = ("DeepseekV41LLMForCausalLM", "DeepseekV41ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV32ForCausalLM",
         "DSparkV41DraftModel", "DeepSeekV4MTPModel")


def main() -> int:
    from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    for arch in ARCHS:
        m = ModelRegistry.models[arch]
        path = Path(importlib.util.find_spec(m.module_name).origin)
        m._save_modelinfo_to_cache(_ModelInfo.from_model_cls(m.load_model_cls()), m._get_modelinfo_module_hash(path))
        print(f"model info cached: {arch} ({m.module_name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
