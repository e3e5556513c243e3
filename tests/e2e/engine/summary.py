"""SUMMARY.md of a device run (tests/e2e/engine/device.sh): one table row per engine run, then
the cross-run checks (graphs == eager, speculative == plain, serve == generate, the mutation
fails). Reads OUT/<name>.json and OUT/<name>.log. Exit status 1 when a check fails.

    python tests/e2e/engine/summary.py OUT
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # first_token (check (b))

from run_engine import SERVED  # noqa: E402 (the prompt the server is asked for)

LOG_KEYS = ("dsv4_ops plugin (pid", "dsv4_e2e_a100 (pid", "GPU KV cache size", "Maximum concurrency",
            "KV cache", "num_gpu_blocks", "Graph capturing finished", "Capturing CUDA graphs",
            "Model loading took", "Memory profiling", "torch.compile took", "init engine",
            "Available KV cache memory", "Traceback", "Error", "rror:")


def log_lines(path: str) -> list:
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return []
    return [ln for ln in lines if any(k in ln for k in LOG_KEYS)]


def pids(lines, key) -> list:
    return sorted({int(m.group(1)) for ln in lines for m in [re.search(re.escape(key) + r" (\d+)", ln)] if m})


def load(out: str) -> dict:
    runs = {}
    for p in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(p)[:-5]
        try:
            r = json.load(open(p))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(r, dict) or "model" not in r:
            continue
        # the server's own processes (API server, engine core) log into <name>.json.serve.log
        r["_lines"] = log_lines(os.path.join(out, name + ".log")) + log_lines(p + ".serve.log")
        runs[name] = r
    return runs


# Two greedy runs of one bf16 model may part where the reference run's top-2 stand on a near-tie:
# batch shapes change the summation order (split plans, GEMM tiles, next_n, chunk ends), so the
# hidden state before the LM head differs in its last bits, and vLLM's logits are bf16. With raw
# logits recorded (run_engine: logprobs_mode="raw_logits") a near-tie is a top-2 gap within the
# larger of TIE_ULPS bf16 spacings of the reference's top logit and the model's control noise:
# the largest move of a shared greedy token's logit between the plain eager run and its own
# reruns in other batches (its prefix-cache pass, its solo pass of the served prompt), where
# nothing but batch composition differs. That noise must stay under NOISE_CAP_ULPS. Without raw
# logits, a logprob gap under TIE. Near-tie partings are reported, not failed; wider ones fail.
TIE = 0.05
TIE_ULPS = 4
NOISE_CAP_ULPS = 16


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    import math

    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


def parting(ref_tokens, ref_margins, tokens, ref_logits=None, tie_ulps=TIE_ULPS) -> list:
    """[(prompt, position, the reference run's top-2 gap there, the near-tie bound there)] where
    ``tokens`` first part from ``ref_tokens``. ``ref_logits``: the reference run's top-2
    [(token, raw logit)] per prompt and position (bound ``tie_ulps`` bf16 spacings of its top
    logit); None: logprobs only (bound TIE)."""
    out = []
    for i, (a, b) in enumerate(zip(ref_tokens, tokens or [])):
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None and len(a) != len(b):
            j = min(len(a), len(b))
        if j is not None:
            m = (ref_margins or [None] * len(ref_tokens))[i] or []
            t2 = (ref_logits[i] if ref_logits and i < len(ref_logits) else None) or []
            bound = tie_ulps * bf16_ulp(t2[j][0][1]) if j < len(t2) and t2[j] else TIE
            out.append((i, j, m[j] if j < len(m) else None, bound))
    return out


def logits_of(r: dict, key: str = "top2"):
    """The run's per-position top-2 as raw logits, or None where it recorded logprobs."""
    return r.get(key) if (r.get("engine_kwargs") or {}).get("logprobs_mode") == "raw_logits" else None


def spec_k(r: dict) -> int:
    """The run's speculative token count k (0 without speculative decoding)."""
    spec = r.get("spec") or ""
    return int(spec.split(":")[1]) if ":" in spec else 0


def expected_next_n(r: dict):
    """The next_n a spec:k run's verify steps must reach paged_mqa_logits with: 1 where vLLM
    flattens them (``indexer_flattened``, recorded by run_engine), else k + 1; None unrecorded."""
    f = r.get("indexer_flattened")
    return None if f is None else 1 if f else spec_k(r) + 1


def _shared_moves(a, b, ulps: bool = False) -> list:
    """One prompt's per-position top-2 records of two runs: the |move| of the shared greedy
    token's value (logprob, or raw logit where recorded so) at each position before their greedy
    tokens part; with ``ulps``, in bf16 spacings of that value."""
    out = []
    for x, y in zip(a or [], b or []):
        if not x or not y or x[0][0] != y[0][0]:
            break
        d = abs(x[0][1] - y[0][1])
        out.append(d / bf16_ulp(x[0][1]) if ulps else d)
    return out


def noise_ulps(ref_top2, top2) -> float | None:
    """The largest move of a shared greedy token's raw logit between two runs, over every prompt's
    positions before the runs part, in bf16 spacings of that logit (None: nothing shared)."""
    moves = [m for a, b in zip(ref_top2 or [], top2 or []) for m in _shared_moves(a, b, ulps=True)]
    return round(max(moves), 2) if moves else None


def near_ties_only(parts) -> bool:
    return bool(parts) and all(m is not None and m <= bound for _, _, m, bound in parts)


def drift(ref_top2, top2, parts) -> list:
    """For each parting (prompt, position, gap, bound): the largest move of the shared greedy
    token's value over the positions before it (None without top-2 records): how far the two
    runs' numbers had already moved apart when they parted."""
    out = []
    for i, j, *_ in parts:
        a = ref_top2[i] if ref_top2 and i < len(ref_top2) else None
        b = top2[i] if top2 and i < len(top2) else None
        d = _shared_moves(a[:j], b[:j]) if a and b else []
        out.append(round(max(d), 4) if d else None)
    return out


def mutated(name, r) -> bool:
    return bool(r.get("mutation") or worker(r, "worker_after").get("mutation")
                or worker(r, "worker_before").get("mutation") or "mutat" in name)


def worker(r, key):
    w = r.get(key) or []
    return w[0] if w else {}


def main(out: str) -> int:
    runs = load(out)
    failures = []
    try:
        oracle = json.load(open(os.path.join(out, "first_token.json")))
    except (OSError, json.JSONDecodeError):
        oracle = {}
    print("| run | model | mode | spec | plugin pids (dsv4_ops / platform) | worker pid: platform, capability, plugin routed |"
          " KV blocks | block | graph sizes | startup s | generate s | compiles after warmup | tripped |"
          " peak alloc / reserved MiB (generation) | vLLM's budget MiB: requested, KV, activation peak | error |")
    print("|" + "---|" * 16)
    for name, r in runs.items():
        L = r["_lines"]
        wb, wa = worker(r, "worker_before"), worker(r, "worker_after")
        comp = (len(wa.get("triton_compiles", [])) - len(wb.get("triton_compiles", []))) if wa else "-"
        mib = lambda x: round(x / 2**20) if isinstance(x, (int, float)) else x  # noqa: E731
        peak = f"{mib(wa.get('max_memory_allocated', 0))} / {mib(wa.get('max_memory_reserved', 0))}" if wa else "-"
        mp = (wa or wb).get("memory_profile") or {}
        budget = (f"{mib(mp.get('requested_memory'))}, {mib(mp.get('available_kv_cache_memory_bytes'))},"
                  f" {mib(mp.get('peak_activation_memory'))}") if mp else "-"
        err = (r.get("error") or "")[:120].replace("|", "/")
        sizes = r.get("cudagraph_capture_sizes")
        print(f"| {name} | {r['model']} | {r['mode']} | {r.get('spec') or '-'} | {pids(L, 'dsv4_ops plugin (pid')} /"
              f" {pids(L, 'dsv4_e2e_a100 (pid')} |"
              f" {(str(wa.get('pid')) + ': ' + str(wa.get('platform')) + ', ' + str(wa.get('capability')) + ', ' + str(wa.get('plugin_routed'))) if wa else '-'} |"
              f" {r.get('num_gpu_blocks')} | {r.get('block_size')} |"
              f" {sizes if r['mode'] == 'graphs' else 'eager'} | {r.get('startup_s')} | {r.get('generate_s')} |"
              f" {comp} | {wa.get('tripped') if wa else '-'} | {peak} | {budget} | {err} |")
        if wa and comp and r["mode"] == "graphs":   # eager runs skip the warmup (vLLM: enforce_eager)
            late = wa.get("triton_compiles", [])[len(wb.get("triton_compiles", [])):]
            split = "triton_compiles_ours" in wa
            ours = wa["triton_compiles_ours"][len(wb.get("triton_compiles_ours", [])):] if split else late
            warm = (r.get("engine_kwargs") or {}).get("kernel_config", {}).get("enable_jit_warmup", True)
            print(f"|  | compiles during generation ({name}): " + (
                f"{len(ours)} of dsv4_ops {sorted(set(ours))[:8]}, {len(late) - len(ours)} of vLLM"
                f" {sorted({c.split('[', 1)[0] for c in late} - {c.split('[', 1)[0] for c in ours})}" if split else
                f"{len(late)} (this report does not tell ours from vLLM's: all counted)")
                + f" (vLLM's JIT warmup {'on' if warm else 'off'}) |" + " |" * 14)
            # ours run through vLLM's JIT warmup (the warm set): with it on, none may compile late.
            # vLLM's own kernels that its warmup registry does not list (the bf16 Triton fused-MoE
            # kernel of the tiny checkpoints' unquantized experts) compile at first use by vLLM's
            # design, on any GPU: reported. Without the split, every late compile counts as ours.
            if warm and ours:
                failures.append(f"{name}: {len(ours)} dsv4_ops Triton compiles during generation: {sorted(set(ours))[:8]}")
        if r.get("replay_profile"):
            rp = r["replay_profile"][0]
            print(f"|  | replay trace ({name}): {rp.get('kernels')} kernels, {rp.get('kernels_in_graph')} from graphs"
                  f" ({rp.get('graph_arg_keys')}), graph API {rp.get('graph_runtime_calls')}; ours {rp.get('ours')};"
                  f" ours in graphs {rp.get('ours_in_graph')} |" + " |" * 14)
        if wa and wa.get("ops_called"):
            print(f"|  | dsv4_ampere ops called ({name}): {wa.get('ops_called')} |" + " |" * 14)
        k = spec_k(r)
        if k and wa and wa.get("ops_called"):
            # the verify steps bring 1 + k tokens a request: they must reach our indexer decode as
            # vLLM shapes them on this platform (next_n = k + 1, or one row a token where it flattens)
            nn = expected_next_n(r)
            got = {x: c for x, c in wa["ops_called"].items() if x.startswith("paged_mqa_logits[")}
            print(f"|  | indexer decode ({name}): vLLM flattens the verify rows: {r.get('indexer_flattened')};"
                  f" expected next_n {nn}; counted {got} |" + " |" * 14)
            if nn is None or not wa["ops_called"].get(f"paged_mqa_logits[next_n={nn}]"):
                failures.append(f"{name}: no paged_mqa_logits call with next_n = {nn} (spec k = {k},"
                                f" flattened {r.get('indexer_flattened')})")
        if r.get("error") and not mutated(name, r):
            failures.append(f"{name}: {err}")
        if wa and "NOT ARMED" in str(wa.get("tripwire")):
            failures.append(f"{name}: tripwire {wa['tripwire']}")
        if wa and wa.get("tripped"):
            failures.append(f"{name}: tripwire {wa['tripped']}")
    print()
    by = {}
    for name, r in runs.items():
        by.setdefault(r["model"], {})[name] = r
    for model, rs in by.items():
        base = next((r for n, r in rs.items() if r["mode"] == "eager" and not r.get("spec")
                     and "mutat" not in n and r.get("tokens")), None)
        print(f"## {model}")
        if base is None:
            print("no plain eager run with tokens")
            continue
        lg = logits_of(base)
        ctrl = [noise_ulps(lg[-3:], base.get("prefix_pass_top2")),
                noise_ulps(lg[SERVED:SERVED + 1], [base.get("solo_top2")])] if lg else []
        ctrl = max((c for c in ctrl if c is not None), default=None)
        tie_ulps = max(TIE_ULPS, ctrl or 0)
        if lg:
            print(f"- control noise (largest shared-token logit move, plain eager run vs its prefix-cache and solo"
                  f" passes): {ctrl} bf16 spacings; near-tie bound {tie_ulps} spacings of the top logit")
        if ctrl is not None and ctrl > NOISE_CAP_ULPS:
            failures.append(f"{model}: one configuration's reruns move a logit by {ctrl} > {NOISE_CAP_ULPS} bf16 spacings")
        pp = parting(base["tokens"][-3:], (base.get("margins") or [None] * 3)[-3:], base.get("prefix_pass_tokens"),
                     lg[-3:] if lg else None, tie_ulps)
        print(f"- prompt lengths {base.get('prompt_lens')}; prefix pass tokens equal first pass: "
              f"{not pp} (cached tokens {base.get('prefix_pass_cached_tokens')}); parting (prompt of the last 3,"
              f" position, first pass's top-2 gap, near-tie bound): {pp}; drift of the shared token's logprob before it:"
              f" {drift((base.get('top2') or [None] * 3)[-3:], base.get('prefix_pass_top2'), pp)}")
        if pp and not near_ties_only(pp):
            failures.append(f"{model}: prefix-cache pass differs {pp}")
        okey = model + ("_fp8" if model == "v32" and str(base.get("cache_dtype")).startswith("fp8") else "")
        if okey in oracle:
            from first_token import CLEAR_MARGIN, agreement

            ag = agreement(oracle[okey], base["tokens"])
            print(f"- first token vs the float64 oracle {okey} (margin > {CLEAR_MARGIN}), prompts the indexer does not"
                  f" select for: {ag['agree']}/{ag['clear']} agree; disagree at {ag['wrong']} (runner-up there:"
                  f" {ag['runner_up_where_wrong']}); unclear {ag['unclear']}; indexer-selected prompts (fp8 keys,"
                  f" not modelled; reported): {ag['selected_agree']}/{ag['selected']} agree, differ at {ag['selected_wrong']}")
            if ag["wrong"]:
                failures.append(f"{model}: first token differs from the float64 oracle at {ag['wrong']}")
        else:
            print("- first token vs the float64 oracle: no oracle for this model")
        for n, r in rs.items():
            if r is base:
                continue
            same = r.get("tokens") == base["tokens"]
            if mutated(n, r):
                ok = not same
                print(f"- {n} (topk_off_by_one mutation, must fail): tokens differ from eager: {not same}"
                      f"{'; error ' + r['error'][:200] if r.get('error') else ''} -> {'FAILS as it must' if ok else 'DID NOT FAIL'}")
                if not ok:
                    failures.append(f"{n}: the mutation did not change the output")
                continue
            if r.get("tokens") is not None:
                pt = parting(base["tokens"], base.get("margins"), r.get("tokens"), lg, tie_ulps)
                dr = drift(base.get("top2"), r.get("top2"), pt)
                nz = noise_ulps(lg, logits_of(r)) if lg else None
                print(f"- {n} ({r['mode']}, spec {r.get('spec') or '-'}): tokens == eager: {same}"
                      f"{'' if same else f' (parting: prompt, position, eager top-2 gap, near-tie bound: {pt}; drift before it: {dr})'}"
                      f"; largest shared-token logit move {nz} bf16 spacings")
            elif not r.get("serve"):
                print(f"- {n} ({r['mode']}, spec {r.get('spec') or '-'}): no tokens")
            if r.get("tokens") is not None and not same and not near_ties_only(pt):
                failures.append(f"{n}: tokens differ from eager {pt}")
            s = r.get("serve")
            if s:
                # the server runs the prompt alone: compared exactly with the eager run's solo pass of it
                # (a record without one: with the prompt in the 13-prompt batch)
                st = s.get("token_ids") or s.get("token_ids_from_text")
                ref, what = ((base["solo_tokens"], "its solo pass") if base.get("solo_tokens")
                             else (base["tokens"][SERVED], "the 13-prompt batch"))
                ok = st == ref
                print(f"- {n} serve: ready {s.get('ready_s')} s, /v1/completions tokens == LLM.generate ({what}):"
                      f" {ok}, exit rc {s.get('exit_rc')}{'; error ' + s['error'] if s.get('error') else ''}")
                if not ok:
                    failures.append(f"{n}: serve tokens differ or missing")
        print("- log lines (base run):")
        for ln in base["_lines"][:40]:
            print(f"    {ln[:220]}")
    print("\nFAILURES:" if failures else "\nall checks passed")
    for f in failures:
        print(f"- {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
