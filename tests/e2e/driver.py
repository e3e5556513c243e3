"""End-to-end driver: one process runs vLLM's DeepSeek model with the plugin (see
test_e2e.py, which runs this module in a subprocess and reads its JSON report)."""

from __future__ import annotations

import argparse
import os
import json
import sys
import time


PHASES: dict = {}          # wall seconds of each phase of this process (the report's "phases")
_last = [time.time()]


def mark(name: str) -> None:
    """Close the phase ``name``: the wall time since the previous mark (or the process start)."""
    now = time.time()
    PHASES[name] = round(PHASES.get(name, 0.0) + now - _last[0], 1)
    _last[0] = now


def setup(device: str):
    import os
    sys.path.insert(0, os.path.dirname(__file__))
    import platform_spoof
    cpu = device == "cpu"
    platform_spoof.set_environment(cpu)
    if cpu:
        import interpreter_patch
        interpreter_patch.apply()
    import torch  # noqa: F401
    import standins
    standins.install(cpu=cpu)
    if not cpu:
        platform_spoof.gpu_import_standins()
    import vllm  # noqa: F401
    if not cpu:
        import vllm.platforms  # noqa: F401
        platform_spoof.gpu_after_import()
    platform_spoof.spoof_platform(cpu)
    if cpu:
        platform_spoof.cpu_streams()
    from dsv4_ops.vllm import plugin
    plugin.register()
    assert plugin.STATE.routed, f"plugin did not route: {plugin.STATE}"
    platform_spoof.enable_cuda_answers()
    if cpu:
        platform_spoof.inspect_models_in_process()
    mark("setup")
    return plugin


def run_model(model_name: str, device: str) -> dict:
    """Build, run the steps, check every layer; returns the report."""
    import torch
    import build
    import capture
    import checks
    import standins
    import steps
    import tripwire
    from dsv4_ops.vllm import plugin

    import vllm.models.deepseek_v41.nvidia.model  # noqa: F401 (the modules whose names are rebound)
    report = dict(model=model_name, device=device, mhc_standins=standins.install_mhc())
    standins.install_flashmla_metadata()
    if device == "cpu":
        import platform_spoof
        platform_spoof.cpu_vllm_streams()
    mark("imports")
    report["tripwire"] = tripwire.install(model_name, plugin.STATE.originals)
    mark("tripwire")
    report["mutation"] = mutate(os.environ.get("DSV4_E2E_MUTATE", ""))
    import counters
    from dsv4_ops.vllm import attention as ampere_attention
    import vllm.models.deepseek_v4.nvidia.model  # noqa: F401
    flashmla = {"v41": "vllm.models.deepseek_v41.nvidia.flashmla", "v4": "vllm.models.deepseek_v4.nvidia.flashmla"}
    counters.install(model_name, [ampere_attention.make_ampere_attention_cls(
        sys.modules[flashmla[model_name]].DeepseekV4FlashMLAAttention)])
    counters.install_ops()
    cfg = build.CONFIGS[model_name]
    b = build.build(cfg, device)
    mark("build")
    cc = b.vllm_config.cache_config
    report["resolved"] = dict(block_size=cc.block_size, cache_dtype=str(cc.cache_dtype),
                              kv_cache_layout=str(cc.kv_cache_layout), kernel_block_sizes=b.kernel_block_sizes,
                              groups=[type(g.kv_cache_spec).__name__ for g in b.kv_cache_config.kv_cache_groups])
    rec = capture.Recorder(b.model)
    sch = steps.Scheduler(b)
    seed = int(os.environ.get("DSV4_E2E_SEED") or int.from_bytes(os.urandom(4), "little"))
    report["seed"] = seed
    run = Run(model_name, cfg, b, rec, sch, seed)
    report["trace"] = []   # per step: logits and every discrete choice (CPU-vs-GPU comparisons)
    only = os.environ.get("DSV4_E2E_STEPS")
    chk = run.plan(only.split(",") if only else None, trace=report["trace"] if os.environ.get("DSV4_E2E_TRACE") else None)
    mark("steps")
    report["checks"] = chk.results
    report["graph"] = []
    if device != "cpu" and not only:
        import graph_check
        gd = graph_check.GraphDecode(sch, rec)
        for i in range(4):
            report["graph"].append(gd.step([(0, 1), (1, 1)], f"graph{i}"))
    report["private_graphs"] = private_graph_stats(b.model)
    report["standin_calls"] = dict(standins.CALLS)
    report["triton_launches"] = dict(tripwire.LAUNCHES)
    report["tripped"] = list(tripwire.TRIPPED)
    report["rows_called"] = dict(counters.ROWS)
    report["rows_uncounted"] = list(counters.UNCOUNTED)
    report["ops_called"] = dict(counters.OPS)
    # more runs of the same built model, each on requests of its own (fresh blocks), reported apart
    extras = [e for e in os.environ.get("DSV4_E2E_EXTRAS", "").split(",") if e]
    if "routes" in extras:
        report["routes"] = {kernel: run.forced_route(kernel) for kernel in FORCED_ROUTES}
        mark("routes")
    if "mutations" in extras:
        report["mutations"] = {kind: run.mutated(kind) for kind in EXTRA_MUTATIONS}
        mark("mutations")
    report["positive_control"] = positive_control(plugin)
    mark("finish")
    report["phases"] = dict(PHASES)
    return report


# DSV4_E2E_EXTRAS=routes: the decode routes auto does not take for the tiny model, forced through
# vLLM's forward (DSV4_AMPERE_DECODE_KERNEL, read at each call); =mutations: deliberately broken
# replacements (``mutate``), each on a prefill of its own
FORCED_ROUTES = ("v3", "tiles")
EXTRA_MUTATIONS = ("topk_off_by_one", "unpatched_import")


class Run:
    """The model e2e's steps on one built model: ``plan`` runs the prefill / mixed / decode steps
    on two new requests and checks every layer of every step; each call takes fresh requests
    and blocks, so later plans (a forced route, a mutation) never read what an earlier one wrote."""

    def __init__(self, model_name, cfg, built, rec, sch, seed: int):
        import torch

        self.model, self.cfg, self.b, self.rec, self.sch, self.seed = model_name, cfg, built, rec, sch, seed
        self.g = torch.Generator().manual_seed(seed)
        self.next_rid = 0

    def plan(self, only=None, trace=None):
        import torch
        import checks
        import standins

        chk = checks.Checker(self.b.model, self.cfg)
        chk.fwd_ctx = self.b.vllm_config.compilation_config.static_forward_context
        # prefill longer than top-k x ratio (8 x 2 for V4.1, 8 x 4 for V4) so the long indexer path
        # runs; V4's is longer than 128 so its C128A layer has a compressed entry
        P0, P1 = (40, 24) if self.model == "v41" else (136, 24)
        r0, r1 = self.next_rid, self.next_rid + 1
        self.next_rid += 2
        vocab = self.cfg["vocab_size"]
        self.sch.add(r0, torch.randint(2, vocab, (P0 + 12,), generator=self.g).tolist())
        self.sch.add(r1, torch.randint(2, vocab, (P1 + 12,), generator=self.g).tolist())
        plan = [("prefill", [(r0, P0)]), ("mixed", [(r0, 1), (r1, P1)]), ("decode1", [(r0, 1), (r1, 1)]),
                ("decode2", [(r0, 1), (r1, 1)])]
        standins.RECORD_BOUNDARIES = self.model == "v4"   # V4's mHC boundaries, checked in float64
        try:
            for name, schedule in plan:
                if only and name not in only:
                    continue
                t = time.time()
                standins.BOUNDARIES.clear()
                hidden, logits, bt = self.sch.step(schedule, hook=lambda batch, n=name: self.rec.begin(n, batch))
                step = self.rec.current
                assert torch.isfinite(logits).all(), f"{name}: non-finite logits"
                for i, lr in sorted(step.layers.items()):
                    chk.check_attention(step, lr)
                    chk.check_indexer(step, lr)
                    chk.check_moe(step, lr)
                chk.check_logits(step, hidden, logits)
                chk.check_first_mhc(step, step.layers[0])
                chk.check_mhc_boundaries(step, standins.BOUNDARIES)
                if trace is not None:
                    trace.append(dict(
                        step=name, logits=logits.float().cpu().tolist(),
                        experts={i: lr.experts.tolist() for i, lr in step.layers.items()},
                        topk={i: lr.topk.tolist() for i, lr in step.layers.items() if lr.topk is not None}))
                print(f"step {name} {time.time() - t:.1f}s", flush=True)
        finally:
            standins.RECORD_BOUNDARIES = False
            standins.BOUNDARIES.clear()
        return chk

    def forced_route(self, kernel: str) -> dict:
        """The whole plan with the decode route forced to ``kernel``; its checks and the ops the
        plan called."""
        import counters
        import tripwire
        from dsv4_ops import envs

        before, tripped = dict(counters.OPS), len(tripwire.TRIPPED)
        old = os.environ.get(envs.DECODE_KERNEL)
        os.environ[envs.DECODE_KERNEL] = kernel
        try:
            chk = self.plan()
        finally:
            if old is None:
                os.environ.pop(envs.DECODE_KERNEL)
            else:
                os.environ[envs.DECODE_KERNEL] = old
        return dict(model=self.model, seed=self.seed, kernel=kernel, checks=chk.results,
                    tripped=tripwire.TRIPPED[tripped:],
                    ops_called={k: v - before.get(k, 0) for k, v in counters.OPS.items() if v > before.get(k, 0)})

    def mutated(self, kind: str) -> dict:
        """A prefill with the mutation ``kind`` in place (undone after): its checks, or the error
        that stopped it (with its traceback)."""
        import traceback

        import tripwire

        tripped = len(tripwire.TRIPPED)
        out = dict(mutation=mutate(kind), checks=[], error="")
        try:
            out["checks"] = self.plan(["prefill"]).results
        except Exception as exc:  # noqa: BLE001 (the test reads which error, and where)
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["traceback"] = traceback.format_exc()[-6000:]
        finally:
            unmutate()
        out["tripped"] = tripwire.TRIPPED[tripped:]
        del tripwire.TRIPPED[tripped:]
        return out


def private_graph_stats(model) -> dict:
    """The DSV4_AMPERE_DECODE_GRAPHS caches' counters summed over the model's layers."""
    from dsv4_ops.vllm import decode_graph

    total: dict = {}
    for m in model.modules():
        cache = m.__dict__.get(decode_graph._CACHE_ATTR)
        for k, v in (cache.stats.items() if cache is not None else ()):
            total[k] = total.get(k, 0) + v
    return total


_UNDO: list = []   # (module, name, value) bindings a mutation replaced


def _rebind(mod, name, value) -> None:
    _UNDO.append((mod, name, getattr(mod, name)))
    setattr(mod, name, value)


def unmutate() -> None:
    while _UNDO:
        mod, name, value = _UNDO.pop()
        setattr(mod, name, value)


def mutate(kind: str) -> str:
    """Deliberately broken replacements (the test shows each one makes the run fail):
    ``topk_off_by_one``: the sparse-prefill replacement reads workspace row i+1 for index i;
    ``unpatched_import``: one by-name import of a replaced original left unpatched."""
    if not kind:
        return ""
    from dsv4_ops.vllm import attention as va
    from dsv4_ops.vllm import plugin

    if kind == "topk_off_by_one":
        good = va.flash_mla_sparse_fwd_ampere

        def broken_of(bound):
            def broken(q, kv, indices, *a, **k):
                return bound(q, kv, torch_where_valid_plus_one(indices, kv.shape[0]), *a, **k)
            return broken

        n = 0
        for mod in list(sys.modules.values()):
            cur = getattr(mod, "flash_mla_sparse_fwd", None) if getattr(mod, "__name__", "").startswith("vllm") else None
            # the replacement itself, or the e2e's call counter around it (counters.install)
            if cur is not None and (cur is good or getattr(cur, "__wrapped__", None) is good):
                _rebind(mod, "flash_mla_sparse_fwd", broken_of(cur))
                n += 1
        return f"{kind} ({n} bindings)"
    if kind == "unpatched_import":
        import vllm.models.deepseek_v41.attention as a41

        _rebind(a41, "indexer_k_norm_rope_store", plugin.STATE.originals[
            ("vllm.models.deepseek_v41.attention", "indexer_k_norm_rope_store")][2])
        return kind
    import plants

    if kind in plants.PLANTS:   # the bound-margin plants (issue 29): plants.py
        return plants.plant(kind)
    raise ValueError(f"unknown DSV4_E2E_MUTATE={kind!r}")


def torch_where_valid_plus_one(indices, n_rows: int):
    import torch

    return torch.where((indices >= 0) & (indices + 1 < n_rows), indices + 1, indices)


def positive_control(plugin) -> list:
    """The tripwire fires. Each control must raise DeadOnSm80: a by-name import the plugin
    missed (the replaced original bound again in a vLLM module), a DeepGEMM wrapper, a Triton
    kernel the audit lists dead, and a Triton launch with an fp8 tensor."""
    import torch
    import triton
    import triton.language as tl
    import tripwire
    import vllm.models.deepseek_v41.attention as a41
    import vllm.utils.deep_gemm as dg
    from vllm.models.deepseek_v41.common.ops import indexer_k_store

    original = plugin.STATE.originals[("vllm.models.deepseek_v41.attention", "indexer_k_norm_rope_store")][2]
    replacement = a41.indexer_k_norm_rope_store

    @triton.jit
    def _probe_kernel(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr))

    def missed_import():
        a41.indexer_k_norm_rope_store = original      # as if a module had imported it by name
        try:
            tripwire.install_originals(plugin.STATE.originals)
            a41.indexer_k_norm_rope_store()
        finally:
            a41.indexer_k_norm_rope_store = replacement

    controls = (("missed by-name import of a replaced original", missed_import),
                ("DeepGEMM fp8_fp4_mqa_logits", lambda: dg.fp8_fp4_mqa_logits()),
                ("audit-dead Triton kernel", lambda: indexer_k_store._indexer_k_norm_rope_quant_store_kernel[(1,)]()),
                ("fp8 tensor into a Triton kernel", lambda: _probe_kernel[(1,)](torch.zeros(4, dtype=torch.float8_e4m3fn))))
    fired = []
    for what, fn in controls:
        try:
            fn()
            fired.append(f"NOT FIRED {what}: returned")
        except tripwire.DeadOnSm80:
            fired.append(what)
        except Exception as exc:  # noqa: BLE001
            fired.append(f"NOT FIRED {what}: {type(exc).__name__}: {exc}"[:300])
    tripwire.TRIPPED.clear()
    return fired


def main(argv=None):
    import os
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v41")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    setup(a.device)
    report = run_model(a.model, a.device)
    text = json.dumps(report, indent=1, default=str)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
