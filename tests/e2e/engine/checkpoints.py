"""Tiny HF-style checkpoint directories (config.json, bf16 safetensors, a locally built
tokenizer.json) for DeepSeek-V4.1, V4 and V3.2, read by vLLM's own loader.

V4.1 / V4 tensors are named as the original DeepSeek checkpoints name them (``layers.N.attn.wq_a``,
``layers.N.ffn.experts.E.w1``, ``embed.weight``, ``head.weight``, ...): the writer builds vLLM's
model class on the CPU harness (tests/e2e/driver.py setup), draws random weights with
``build.init_weights`` and splits vLLM's fused parameters back into the checkpoint's pieces, so
``load_weights`` exercises the model's real ``hf_to_vllm_mapper`` and stacked/expert loaders.
V4.1 carries DSpark draft stages (``mtp.{stage}.*``, loaded by vLLM's ``DSparkV41DraftModel``);
``v41x`` is V4.1 plus one Engram layer (fp8 table, ue8m0 scale) under vLLM's VL architecture name.
V3.2 is written by transformers' own ``save_pretrained`` (v32_checkpoint.write).
``verify`` reloads each directory into a fresh model with vLLM's ``get_model_loader`` and
``process_weights_after_loading`` and compares every parameter with what was written.

    usage (CPU): python tests/e2e/engine/checkpoints.py OUT_DIR [v41 v41x v4 v32] [--verify]
      (also writes OUT_DIR/manifest.json: vLLM's parameter names/shapes)
    the device: python tests/e2e/engine/checkpoints.py OUT_DIR v41 v41x v4 v32 --from-manifest MANIFEST
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))   # tests/e2e (build, driver, v32_checkpoint)

# Engine-sized geometry: the e2e configs (build.CONFIGS), with room for 1024-token prompts.
MAX_LEN = 4096


# V4.1's DSpark draft (vLLM's ``DSparkV41DraftModel``, method "dspark"): its stages ship in the
# target checkpoint as ``mtp.{stage}.*`` (a decoder layer each; ``main_proj`` / ``main_norm`` on
# stage 0, ``norm`` / ``markov_head`` / ``confidence_head`` on the last), the draft config is the
# target's. The stages read the target's aux hidden states after layers 1 and 3 (one-based: the
# posts of layers 0 and 2).
V41_DSPARK = dict(n_mtp_layers=2, dspark_target_layer_ids=[1, 3], dspark_markov_rank=16,
                  dspark_block_size=5, dspark_noise_token_id=2)


def configs() -> dict:
    import build
    import v32_checkpoint

    v41 = dict(build.V41_CONFIG, max_position_embeddings=MAX_LEN, **V41_DSPARK)
    # the draft stages are decoder layers num_hidden_layers.. (per-layer lists cover them)
    v41["compress_ratios"] = v41["compress_ratios"] + [0] * V41_DSPARK["n_mtp_layers"]
    # one MTP layer (``mtp.0.*``): V4's speculative path (method "mtp") drafts with it
    v4 = dict(build.V4_CONFIG, max_position_embeddings=MAX_LEN, num_nextn_predict_layers=1)
    v32 = dict(v32_checkpoint.V32_CONFIG)
    # V4.1 with one Engram layer, under the architecture real V4.1 checkpoints name (vLLM resolves
    # an EngramConfig for that name only, config/engram.py); the engine maps it to the text class
    v41x = dict(v41, architectures=["DeepseekV41ForCausalLM"], **engram_keys(v41))
    return {"v41": v41, "v41x": v41x, "v4": v4, "v32": v32}


def engram_keys(cfg: dict) -> dict:
    """Engram config keys for one layer before the last KV source (the decoder replay needs it
    there): 2- and 3-grams, 2 hash heads of 32 dims each; the compressed vocab is what vLLM's
    ``build_compressed_token_map`` makes of this directory's tokenizer, the table holds exactly
    the layout's prime-sized bucket ranges."""
    from types import SimpleNamespace
    from transformers import AutoTokenizer
    from vllm.models.deepseek_v41.common.engram import EngramLayout, build_compressed_token_map

    d = tempfile.mkdtemp(prefix="dsv4_tok_")
    write_tokenizer(d, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    _, compressed = build_compressed_token_map(AutoTokenizer.from_pretrained(d))
    keys = dict(engram_layer_ids=[1], engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
                engram_vocab_size=257, engram_compressed_vocab_size=compressed,
                engram_pad_token_id=cfg["eos_token_id"], engram_num_embeddings=[0])
    layout = EngramLayout(SimpleNamespace(**keys))
    keys["engram_num_embeddings"] = [sum(p for per in layer for p in per) for layer in layout.primes]
    assert max(keys["engram_layer_ids"]) < max(cfg["kv_source_layer_ids"])
    return keys


def write_tokenizer(d: str, vocab_size: int, bos: int = 0, eos: int = 1) -> None:
    """A WordLevel tokenizer over ``vocab_size`` words (``<s>``, ``</s>``, ``w2`` ...), whitespace
    pre-tokenised, built with the ``tokenizers`` library (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": bos, "</s>": eos}
    for i in range(vocab_size):
        if i not in (bos, eos):
            vocab[f"w{i}"] = i
    vocab["<unk>"] = vocab.pop(f"w{vocab_size - 1}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                       unk_token="<unk>", model_max_length=MAX_LEN, add_bos_token=False), f)


def _split(name: str, t: torch.Tensor, cfg: dict, sizes=None) -> list:
    """One vLLM parameter -> [(checkpoint name, tensor)] in the original checkpoint's naming;
    sizes: the fused module's ``output_sizes`` (MergedColumnParallelLinear)."""
    return [(_ckpt_name(n), x) for n, x in _unfuse(name, t, cfg, sizes)]


def _ckpt_name(name: str) -> str:
    if ".engram.embed_tokens." in name:   # the fp8 table and its ue8m0 scale (vLLM's mapper reroutes)
        return _ckpt_name(name.replace("embed_tokens.weight_scale_inv", "embed.scale")
                          .replace("embed_tokens.weight", "embed.weight"))
    if name == "lm_head.weight":
        return "head.weight"
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    return name[len("model."):] if name.startswith("model.") else name


def _unfuse(name: str, t: torch.Tensor, cfg: dict, sizes) -> list:
    if name.endswith(".attn.fused_wqa_wkv.weight"):
        q = cfg["q_lora_rank"]
        base = name[: -len("fused_wqa_wkv.weight")]
        return [(base + "wq_a.weight", t[:q]), (base + "wkv.weight", t[q:])]
    if name.endswith(".compressor.fused_wkv_wgate.weight"):
        base = name[: -len("fused_wkv_wgate.weight")]
        if len(sizes) == 1:   # ratio 1 pools single tokens: the checkpoint carries no gate
            return [(base + "wkv.weight", t)]
        h = sizes[0]
        return [(base + "wkv.weight", t[:h]), (base + "wgate.weight", t[h:])]
    if name.endswith(".shared_experts.gate_up_proj.weight"):
        h = t.shape[0] // 2
        base = name[: -len("gate_up_proj.weight")]
        return [(base + "w1.weight", t[:h]), (base + "w3.weight", t[h:])]
    if name.endswith(".shared_experts.down_proj.weight"):
        return [(name.replace(".down_proj.", ".w2."), t)]
    if name.endswith(".experts.routed_experts.w13_weight"):
        base = name[: -len("routed_experts.w13_weight")]
        h = t.shape[1] // 2
        out = []
        for e in range(t.shape[0]):
            out += [(f"{base}{e}.w1.weight", t[e, :h]), (f"{base}{e}.w3.weight", t[e, h:])]
        return out
    if name.endswith(".experts.routed_experts.w2_weight"):
        base = name[: -len("routed_experts.w2_weight")]
        return [(f"{base}{e}.w2.weight", t[e]) for e in range(t.shape[0])]
    if name.endswith(".ffn.gate.e_score_correction_bias"):
        return [(name.replace("e_score_correction_bias", "bias"), t)]
    return [(name, t)]


def dspark_config(cfg: dict) -> dict:
    """The draft config vLLM's ``SpeculativeConfig`` makes of a V4.1 target's (config/speculative.py:
    method "dspark" keeps the target's config, renames the architecture)."""
    return dict(cfg, architectures=["DSparkV41DraftModel"])


class _DraftSpec:
    """What vLLM's MTP layer reads of ``speculative_config`` at construction (the draft config is
    the target's hf_config with vLLM's ``hf_config_override`` for V4: n_predict, the MTP arch)."""

    method = "mtp"
    num_speculative_tokens = 1

    def __init__(self, draft_model_config):
        self.draft_model_config = draft_model_config

    def use_dspark(self) -> bool:
        return False

    def __getattr__(self, name):   # any other feature query (v2-runner support, eagle, ...): off
        return _Off()


class _Off:
    def __bool__(self):
        return False

    def __call__(self, *a, **k):
        return False


def mtp_config(cfg: dict) -> dict:
    """vLLM's ``SpeculativeConfig.hf_config_override`` for V4 (config/speculative.py)."""
    return dict(cfg, architectures=["DeepSeekV4MTPModel"], n_predict=cfg["num_nextn_predict_layers"])


class _DSparkSpec(_DraftSpec):
    method = "dspark"

    def use_dspark(self) -> bool:
        return True


def _build_vllm_model(d: str, draft: bool = False):
    """vLLM's model class for the config in ``d`` (CPU harness already set up); draft: the
    config is a draft (MTP) config and ``speculative_config`` names it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype
    import build

    arch = json.load(open(os.path.join(d, "config.json")))["architectures"][0]
    if arch == "DeepseekV41ForCausalLM":
        # vLLM's name for the VL wrapper; the text class, as the engine's platform entry point maps it
        ModelRegistry.register_model(arch, build.TEXT_MODELS["DeepseekV41LLMForCausalLM"])
    elif arch not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(arch, build.TEXT_MODELS[arch])
    vc = build.make_vllm_config(d, "cpu")
    if vc.engram_config is not None:
        # the CPU harness: the table in ordinary memory (the engine keeps vLLM's default, pinned host
        # memory read through UVA)
        from vllm.config import EngramConfig
        vc.engram_config = EngramConfig(cpu_offload=False)
    if draft:
        spec = _DSparkSpec if arch == "DSparkV41DraftModel" else _DraftSpec
        vc.speculative_config = spec(vc.model_config)
    ctx = set_current_vllm_config(vc)
    ctx.__enter__()
    _init_distributed()
    cls, _ = ModelRegistry.resolve_model_cls(vc.model_config.architectures, vc.model_config)
    with set_default_torch_dtype(torch.bfloat16), _cpu_device_queries():
        model = cls(vllm_config=vc, prefix="")
    return model, vc, ctx


class _cpu_device_queries:
    """The two device queries ``ParallelEngramEmbedding.__init__`` makes (device index, SM count
    for its lookup launch), answered as one A100 would, for the model build on the CPU only."""

    def __enter__(self):
        from types import SimpleNamespace

        self._saved = (torch.accelerator.current_device_index, torch.cuda.get_device_properties)
        if not torch.cuda.is_available():
            torch.accelerator.current_device_index = lambda: 0
            torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(multi_processor_count=108)
        return self

    def __exit__(self, *exc):
        torch.accelerator.current_device_index, torch.cuda.get_device_properties = self._saved


def _init_distributed():
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed import parallel_state

    if parallel_state._WORLD is None:
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
        initialize_model_parallel(1, 1)


def manifest(kind: str, cfg: dict) -> dict:
    """What the writer needs of vLLM's model, read on the CPU harness: every parameter (and the
    hash-routing buffer) in ``named_parameters`` order with shape, dtype and, for a fused linear,
    its ``output_sizes``. The device rewrites the same bytes from it (``write_v4``) without
    building vLLM's model."""
    d = tempfile.mkdtemp(prefix=f"dsv4_manifest_{kind}_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_tokenizer(d, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])   # Engram's hash reads it
    model, _vc, ctx = _build_vllm_model(d)
    sizes = {f"{m}.weight": getattr(mod, "output_sizes", None) for m, mod in model.named_modules()}
    params = [dict(name=n, shape=list(p.shape), dtype=str(p.dtype).replace("torch.", ""), sizes=sizes.get(n))
              for n, p in model.named_parameters()]
    bufs = [dict(name=n, shape=list(b.shape), dtype=str(b.dtype).replace("torch.", ""))
            for n, b in model.named_buffers() if n.endswith("tid2eid")]
    ctx.__exit__(None, None, None)
    man = dict(kind=kind, config=cfg, params=params, buffers=bufs)
    draft_cfg = (mtp_config(cfg) if cfg.get("num_nextn_predict_layers")
                 else dspark_config(cfg) if cfg.get("n_mtp_layers") else None)
    if draft_cfg is not None:
        dm = tempfile.mkdtemp(prefix=f"dsv4_manifest_{kind}_draft_")
        with open(os.path.join(dm, "config.json"), "w") as f:
            json.dump(draft_cfg, f)
        model, _vc, ctx = _build_vllm_model(dm, draft=True)
        sizes = {f"{m}.weight": getattr(mod, "output_sizes", None) for m, mod in model.named_modules()}
        man["mtp"] = [dict(name=n, shape=list(p.shape), dtype=str(p.dtype).replace("torch.", ""), sizes=sizes.get(n))
                      for n, p in model.named_parameters()]
        ctx.__exit__(None, None, None)
    return man


# DSpark parameters the draft shares with the target (aliased by vLLM's speculator; not in mtp.*)
DSPARK_ALIASED = ("model.embed_tokens.weight", "lm_head.weight")
# vLLM 0.34.0's DSpark draft projects the main model's hidden state for every stage at once
# (``DSparkDeepseekV4Model.context_wkv_proj``, a MergedColumnParallelLinear of one ``head_dim``
# block per stage); its loader fills it from the checkpoint's ``mtp.{i}.attn.wkv.weight``
# (``_duplicate_context_wkv_weights``): no tensor of its own in the checkpoint
DSPARK_CONTEXT_WKV = "model.context_wkv_proj."


def _dspark_ckpt_name(name: str, cfg: dict) -> str:
    """A vLLM DSpark draft parameter name -> the checkpoint's ``mtp.{stage}.*`` name (the inverse
    of ``DSparkDeepseekV4ForCausalLM._remap_dspark_name``)."""
    import re

    last = cfg["n_mtp_layers"] - 1
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    if m:
        return f"mtp.{m.group(1)}.{m.group(2)}"
    rest = name[len("model."):]
    if rest.startswith(("main_proj.", "main_norm.")):
        return f"mtp.0.{rest}"
    rest = rest.replace("markov_head.markov_w1.", "markov_head.embed.").replace("markov_head.markov_w2.",
                                                                                "markov_head.head.")
    return f"mtp.{last}.{rest}"


def _mtp_ckpt_name(name: str, cfg: dict) -> str:
    """A vLLM MTP parameter name -> the checkpoint's ``mtp.{i}.*`` name (the inverse of
    ``DeepSeekV4MTP.load_weights``' renames)."""
    import re

    if cfg.get("n_mtp_layers"):
        return _dspark_ckpt_name(name, cfg)

    if name == "model.embed_tokens.weight":
        return "mtp.0.emb.tok_emb.weight"
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", name)
    assert m, name
    i, rest = int(m.group(1)) - cfg["num_hidden_layers"], m.group(2)
    rest = rest.replace("mtp_block.", "", 1).replace("shared_head.head.", "head.").replace("shared_head.norm.", "norm.")
    return f"mtp.{i}.{rest}"


class _Shell(torch.nn.Module):
    """Stand-in with vLLM's parameter names and shapes, so ``build.init_weights`` draws exactly
    what it draws for vLLM's model (same order, same rules)."""

    def __init__(self, params: list, buffers: list = ()):
        super().__init__()
        self._p = [(e["name"], torch.nn.Parameter(torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"])),
                                                  requires_grad=False)) for e in params]
        self._b = [(e["name"], torch.zeros(e["shape"], dtype=getattr(torch, e["dtype"]))) for e in buffers]

    def named_parameters(self, *a, **k):
        return iter(self._p)

    def named_buffers(self, *a, **k):
        return iter(self._b)


def write_v4(man: dict, d: str, seed: int = 0) -> dict:
    """V4.1 / V4 from a manifest: config.json, tokenizer, model.safetensors (original names).
    Returns {vLLM name: written tensor}."""
    from safetensors.torch import save_file
    import build

    cfg = man["config"]
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    write_tokenizer(d, cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"])
    shell = _Shell(man["params"], man["buffers"])
    build.init_weights(shell, seed)
    _stable_routing(shell, seed)
    _draw_engram_tables(shell, seed)
    sizes = {e["name"]: e["sizes"] for e in man["params"]}
    tensors, params = {}, {}
    for name, p in list(shell.named_parameters()) + list(shell.named_buffers()):
        params[name] = p.detach().clone()
        for ck, t in _split(name, p.detach(), cfg, sizes.get(name)):
            assert ck not in tensors, ck
            tensors[ck] = t.contiguous().clone()
    if man.get("mtp"):   # the MTP layer's own draws (another seed), named mtp.{i}.*
        shell = _Shell(man["mtp"])
        build.init_weights(shell, seed + 1)
        _stable_routing(shell, seed + 1)
        msizes = {e["name"]: e["sizes"] for e in man["mtp"]}
        derived, written = [], {}
        for name, p in shell.named_parameters():
            if cfg.get("n_mtp_layers") and name in DSPARK_ALIASED:
                continue
            if name.startswith(DSPARK_CONTEXT_WKV):
                derived.append(name)
                continue
            params["mtp:" + name] = p.detach().clone()
            for vname, t in _unfuse(name, p.detach(), cfg, msizes.get(name)):
                ck = _mtp_ckpt_name(vname, cfg)
                assert ck not in tensors, ck
                tensors[ck] = t.contiguous().clone()
                written[vname] = tensors[ck]
        for name in derived:   # what vLLM's loader makes of the stages' wkv weights
            suffix = name[len(DSPARK_CONTEXT_WKV):]
            params["mtp:" + name] = torch.cat([written[f"model.layers.{i}.attn.wkv.{suffix}"]
                                              for i in range(cfg["n_mtp_layers"])])
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return params


# The gap between consecutive experts' routing biases: far above the spread of the routing scores
# (sqrtsoftplus of an O(1) logit), so the biases alone choose each layer's experts.
ROUTING_BIAS_STEP = 64.0


def _stable_routing(shell, seed: int) -> None:
    """Every score-routed MoE layer (``e_score_correction_bias``, added to the scores for the
    choice only) chooses the same experts for every token: a random order of the experts a layer,
    biases ``ROUTING_BIAS_STEP`` apart. Random tiny models have near-flat routing scores, so a
    rounding difference between two batch shapes flips an expert and moves the logits by tenths
    (engine call 7: one configuration parted from itself at top-2 gaps up to 0.47); with the choice
    fixed, the MoE stays continuous in its input and two runs part only where the logits tie. The
    gating weights (the scores) still depend on the token; routing itself is checked per call by
    the CPU e2e's float64 MoE checks."""
    g = torch.Generator().manual_seed(seed + 11)
    for name, p in shell.named_parameters():
        if name.endswith(".gate.e_score_correction_bias"):
            E = p.shape[-1]
            order = torch.randperm(E, generator=g)
            bias = torch.empty(E, dtype=torch.float32)
            bias[order] = ROUTING_BIAS_STEP * torch.arange(E, 0, -1, dtype=torch.float32)
            p.data.copy_(bias.to(p.dtype))


def _draw_engram_tables(shell, seed: int) -> None:
    """The Engram tables ``init_weights`` leaves alone: fp8 e4m3 rows of unit scale, ue8m0 scale
    bytes 2**-3 .. 2**0 (exponent bytes 124..127)."""
    g = torch.Generator().manual_seed(seed + 7)
    for name, p in shell.named_parameters():
        if name.endswith("engram.embed_tokens.weight"):
            p.data.copy_((torch.randn(p.shape, generator=g) * 0.5).to(p.dtype))
        elif name.endswith("engram.embed_tokens.weight_scale_inv"):
            p.data.copy_(torch.randint(124, 128, p.shape, generator=g).to(p.dtype))


def write_v32(d: str) -> None:
    import shutil
    import v32_checkpoint

    src = v32_checkpoint.write("v32")
    shutil.copytree(src, d, dirs_exist_ok=True)
    shutil.rmtree(src, ignore_errors=True)
    write_tokenizer(d, v32_checkpoint.V32_CONFIG["vocab_size"])


def _load_and_check(model, vc, expected: dict, prefix: str = "", skip=()) -> tuple:
    """``skip``: parameters the checkpoint does not hold for this model (a draft's aliases of the
    target's), neither poisoned nor counted."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    for name, p in model.named_parameters():            # poison: an unloaded element shows as NaN
        if p.is_floating_point() and name not in skip:
            p.data.fill_(float("nan"))
    get_model_loader(vc.load_config).load_weights(model, vc.model_config)
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    n, compared, bad = 0, 0, []
    for name, p in model.named_parameters():
        if name in skip:
            continue
        n += 1
        if p.is_floating_point() and torch.isnan(p).any():
            bad.append(f"{prefix}{name}: NaN after load")
        elif expected is not None and prefix + name in expected:
            compared += 1
            a, b = p.detach(), expected[prefix + name]
            if a.dtype == torch.float8_e4m3fn:   # compared as bytes (no fp8 equal on the CPU)
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            if not torch.equal(a, b):
                bad.append(f"{prefix}{name}: differs from the written tensor")
    return n, compared, bad


def verify_mtp(d: str, expected: dict = None) -> dict:
    """V4's MTP draft model (vLLM's ``DeepSeekV4MTP``, as the speculative path builds it from the
    target's config) loaded from the same safetensors with vLLM's loader."""
    cfg = json.load(open(os.path.join(d, "config.json")))
    dspark = bool(cfg.get("n_mtp_layers"))
    dm = tempfile.mkdtemp(prefix="dsv4_verify_mtp_")
    with open(os.path.join(dm, "config.json"), "w") as f:
        json.dump(dspark_config(cfg) if dspark else mtp_config(cfg), f)
    os.symlink(os.path.join(os.path.abspath(d), "model.safetensors"), os.path.join(dm, "model.safetensors"))
    model, vc, ctx = _build_vllm_model(dm, draft=True)
    n, compared, bad = _load_and_check(model, vc, expected, prefix="mtp:", skip=DSPARK_ALIASED if dspark else ())
    ctx.__exit__(None, None, None)
    return dict(dir=d + "#mtp", arch=vc.model_config.architectures[0], params=n, compared=compared, mismatched=bad)


def verify_dspark_spec(d: str) -> dict:
    """What the engine's ``speculative_config=dict(method="dspark", num_speculative_tokens=k)``
    (run_engine.py ``v41:...:dspark:K``) resolves to over this checkpoint: vLLM's own
    ``SpeculativeConfig`` for k = 1 and 5 (the draft model, its architecture and target layers)."""
    from vllm.config import ParallelConfig, SpeculativeConfig
    import build

    vc = build.make_vllm_config(d, "cpu")
    out = {}
    for k in (1, 5):
        sc = SpeculativeConfig(method="dspark", num_speculative_tokens=k, target_model_config=vc.model_config,
                               target_parallel_config=ParallelConfig())
        h = sc.draft_model_config.hf_config
        out[str(k)] = dict(method=sc.method, use_dspark=sc.use_dspark(), k=sc.num_speculative_tokens,
                           draft_model=sc.model, arch=sc.draft_model_config.architectures[0],
                           target_layer_ids=list(h.dspark_target_layer_ids),
                           # vLLM 0.34.0: the setting is deprecated (None), DFlash / DSpark always draft in parallel
                           parallel=(sc.parallel_drafting if sc.parallel_drafting is not None
                                     else sc.method in ("dflash", "dspark")))
    return dict(dir=d + "#spec", spec=out, mismatched=[])


def verify(d: str, expected: dict = None) -> dict:
    """Load ``d`` with vLLM's own loader (``get_model_loader().load_weights``: it raises on a
    parameter the checkpoint leaves unloaded) and ``process_weights_after_loading``; compare
    every parameter with ``expected`` (vLLM names) when given. Returns a summary."""
    model, vc, ctx = _build_vllm_model(d)
    n, compared, bad = _load_and_check(model, vc, expected)
    ctx.__exit__(None, None, None)
    return dict(dir=d, arch=vc.model_config.architectures[0], params=n, compared=compared, mismatched=bad)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("models", nargs="*", default=["v41", "v4", "v32"])
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--from-manifest", default="", help="write V4.1/V4 from OUT's manifest JSON (no vLLM)")
    a = ap.parse_args(argv)
    if a.from_manifest:   # the device: no vLLM model build, the same bytes
        mans = json.load(open(a.from_manifest))
        for m in a.models:
            if m == "v32":
                write_v32(os.path.join(a.out, m))
            else:
                write_v4(mans[m], os.path.join(a.out, m))
        return 0
    import driver

    driver.setup("cpu")
    if "v32" in a.models:   # as tests/e2e/driver_v32.py: V3.2's MLA backend through the CUDA selector rules
        import importlib
        import platform_spoof
        import standins_v32
        import vllm.models.deepseek_v32 as v32_pkg
        from dsv4_ops.vllm import plugin, v32_backend

        standins_v32.install()
        platform_spoof.cpu_cuda_attention_selector()
        v32_backend.check_registration(plugin.VllmPatchError)
        v32_backend.install()
        importlib.reload(v32_pkg)
    cfgs = configs()
    results, mans = [], {}
    for m in a.models:
        d = os.path.join(a.out, m)
        if m == "v32":
            write_v32(d)
            exp = None
        else:
            mans[m] = manifest(m, cfgs[m])
            exp = write_v4(mans[m], d)
        if a.verify:
            r = verify(d, exp)
            results.append(r)
            print(json.dumps(r), flush=True)
            if mans.get(m, {}).get("mtp"):
                r = verify_mtp(d, exp)
                results.append(r)
                print(json.dumps(r), flush=True)
            if m == "v41":
                r = verify_dspark_spec(d)
                results.append(r)
                print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(mans, f)
    return 1 if any(r["mismatched"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
