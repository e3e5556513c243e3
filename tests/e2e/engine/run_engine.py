"""One engine run on the device: ``vllm.LLM(model=<checkpoint dir>)`` with the test platform
(tests/e2e/a100_platform, DSV4_E2E_A100=1) and dsv4_ops' plugin loaded by vLLM's own plugin
loader in every process; greedy generation of mixed-length prompts; a JSON report.

    python tests/e2e/engine/run_engine.py --ckpt DIR --model v41 --mode eager|graphs --out R.json
        [--spec-method dspark|mtp --spec-k K] [--serve]

The report: startup seconds, the KV-cache blocks vLLM sized, tokens per prompt (first pass and a
prefix-cache pass), the worker's tripwire / Triton compiles before and after generation, peak
memory; --serve also starts ``vllm serve DIR`` and asks /v1/completions for prompt 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def prompts(vocab: int, seed: int = 0) -> list:
    """13 prompts of mixed lengths: one of 800 tokens (V4.1's decoder replay runs from 768),
    seven short enough that no indexer top-k selects (V3.2: <= 128 tokens; V4: <= 32; check (b)
    is checked on those only), the last three sharing a 200-token prefix (a prefix-cache hit
    recomputes its last window)."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(2, vocab - 1) for _ in range(n)]  # noqa: E731
    shared = tok(200)
    lens = [800, 40, 136, 300, 17, 64, 100, 24, 120, 31]
    ps = [tok(n) for n in lens]
    ps += [shared + tok(n) for n in (24, 90, 150)]
    return ps


# the prompt `vllm serve` is asked for (40 tokens: shorter than a KV block of every model, so no
# prefix-cache hit can make its solo pass differ from the server's fresh one)
SERVED = 1


def top2(out) -> list:
    """Per generated position, the top-2 [(token, raw logit)] vLLM returned (logprobs=2 with
    logprobs_mode="raw_logits"): how far
    two runs' logprobs drift apart on the positions where their tokens still agree."""
    return [sorted(((int(t), round(x.logprob, 4)) for t, x in (lp or {}).items()), key=lambda y: -y[1])[:2]
            for lp in out.outputs[0].logprobs or []]


def margins(out) -> list:
    """Per generated position, the gap between the top-2 raw logits vLLM returned (logprobs=2):
    where two runs' greedy tokens part, this says whether the first one stood on a near-tie."""
    res = []
    for lp in out.outputs[0].logprobs or []:
        v = sorted((x.logprob for x in (lp or {}).values()), reverse=True)
        res.append(round(v[0] - v[1], 4) if len(v) > 1 else None)
    return res


def engine_kwargs(a) -> dict:
    kw = dict(model=a.ckpt, tokenizer=a.ckpt, dtype="bfloat16", seed=0, max_model_len=2048,
              gpu_memory_utilization=a.gpu_mem, max_num_seqs=16, max_num_batched_tokens=a.batched_tokens,
              enforce_eager=a.mode == "eager", enable_prefix_caching=True,
              # logprobs=2 then returns the bf16 logits themselves: a top-2 gap is read in bf16
              # spacings of the top logit (summary.parting's near-tie bound)
              logprobs_mode="raw_logits")
    if a.mode == "graphs" and a.no_jit_warmup:
        # vLLM's JIT warmup off (ours runs through it, so ours is off too): a fallback where the
        # warmup cannot run; by default it runs, the TileLang mHC registrations dropped by the
        # stand-ins where tilelang is absent (standins._install_tilelang_kernels_module)
        kw["kernel_config"] = {"enable_jit_warmup": False}
    if a.spec_method:
        kw["speculative_config"] = dict(method=a.spec_method, num_speculative_tokens=a.spec_k)
    if a.extra:
        kw.update(json.loads(a.extra))
    return kw


def serve_flags(extra: str) -> list:
    """``--extra`` (JSON of LLM(...) kwargs) as ``vllm serve`` flags: scalars only
    (``kv_cache_memory_bytes`` -> ``--kv-cache-memory-bytes N``); ValueError for anything else."""
    flags = []
    for k, v in (json.loads(extra) if extra else {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"--extra {k}: only scalar values become `vllm serve` flags")
        flags += ["--" + k.replace("_", "-"), str(v)]
    return flags


def serve(a, prompt: list, max_tokens: int) -> dict:
    """``vllm serve DIR`` as a subprocess; one /v1/completions request (token-id prompt, greedy);
    SIGINT and wait for a clean exit."""
    import signal
    import subprocess
    import urllib.request

    port = 8765
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.ckpt, "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "2048", "--gpu-memory-utilization", str(a.gpu_mem),
           "--max-num-batched-tokens", str(a.batched_tokens), "--seed", "0"]
    if a.mode == "eager":
        cmd.append("--enforce-eager")
    cmd += serve_flags(a.extra)
    log = open(a.out + ".serve.log", "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    res = dict(cmd=" ".join(cmd[2:]))
    try:
        while time.time() - t0 < a.serve_timeout:
            if p.poll() is not None:
                res["error"] = f"server exited rc={p.returncode} before ready"
                return res
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except Exception:  # noqa: BLE001
                time.sleep(1)
        res["ready_s"] = round(time.time() - t0, 1)
        body = json.dumps(dict(model=a.ckpt, prompt=prompt, max_tokens=max_tokens, temperature=0,
                               ignore_eos=True, return_token_ids=True, logprobs=0)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        r = json.loads(urllib.request.urlopen(req, timeout=120).read())
        ch = r["choices"][0]
        res["token_ids"] = ch.get("token_ids")
        res["text"] = ch.get("text")
        if res["token_ids"] is None and res["text"] is not None:
            # the WordLevel tokenizer's words map back to ids one to one (special tokens excepted)
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(os.path.join(a.ckpt, "tokenizer.json"))
            res["token_ids_from_text"] = [tok.token_to_id(w) for w in res["text"].split()]
        lp = ch.get("logprobs") or {}
        res["logprob_tokens"] = lp.get("tokens")
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            res["exit_rc"] = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            res["exit_rc"] = "killed after 60 s"
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("eager", "graphs"), default="eager")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--n-prompts", type=int, default=13)
    ap.add_argument("--gpu-mem", type=float, default=0.12)
    ap.add_argument("--batched-tokens", type=int, default=256)
    ap.add_argument("--spec-method", default="")
    ap.add_argument("--spec-k", type=int, default=1)
    ap.add_argument("--serve", action="store_true")
    ap.add_argument("--no-jit-warmup", action="store_true", help="graphs: kernel_config.enable_jit_warmup=False")
    ap.add_argument("--serve-only", action="store_true",
                    help="with --serve: no LLM.generate first (the summary compares with the model's eager run)")
    ap.add_argument("--serve-timeout", type=float, default=120)
    ap.add_argument("--extra", default="", help="more LLM(...) keyword arguments, JSON")
    a = ap.parse_args(argv)
    os.environ.setdefault("DSV4_E2E_A100", "1")
    os.environ.setdefault("DSV4_AMPERE_IMPL", "portable")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc(function)
    if a.mode == "eager":   # Python counters of torch.ops.dsv4_ampere calls (no graphs to break)
        os.environ.setdefault("DSV4_E2E_COUNT_OPS", "1")
    report = dict(model=a.model, mode=a.mode, spec=f"{a.spec_method}:{a.spec_k}" if a.spec_method else "",
                  parent_pid=os.getpid(), mutation=os.environ.get("DSV4_E2E_MUTATE", ""))

    def dump():
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    cfg = json.load(open(os.path.join(a.ckpt, "config.json")))
    ps = prompts(cfg["vocab_size"])[: a.n_prompts]
    t0 = time.time()
    try:
        if a.serve and a.serve_only:
            report["serve"] = serve(a, ps[SERVED], a.max_tokens)
            report["total_s"] = round(time.time() - t0, 1)
            dump()
            return 0 if "error" not in report["serve"] else 1
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw = engine_kwargs(a)
        report["engine_kwargs"] = kw
        llm = LLM(**kw)
        report["startup_s"] = round(time.time() - t0, 1)
        cc = llm.llm_engine.vllm_config.cache_config
        report["num_gpu_blocks"] = cc.num_gpu_blocks
        report["block_size"] = cc.block_size
        report["cache_dtype"] = str(cc.cache_dtype)
        comp = llm.llm_engine.vllm_config.compilation_config
        report["cudagraph_mode"] = str(comp.cudagraph_mode)
        report["cudagraph_capture_sizes"] = comp.cudagraph_capture_sizes
        if a.spec_method:
            # vLLM's own choice for this platform: verify steps reach the indexer decode as next_n =
            # k + 1 rows a request, or flattened to one row a token (sm_8x: native for next_n <= 2)
            try:
                from vllm.v1.attention.backends.mla.indexer import _use_flattening

                report["indexer_flattened"] = bool(_use_flattening(llm.llm_engine.vllm_config))
            except Exception as exc:  # noqa: BLE001 (recorded; the summary fails the run without it)
                report["indexer_flattened_error"] = f"{type(exc).__name__}: {exc}"[:300]
        from dsv4_e2e_a100.models import profile_start, profile_stop, reset_peak, worker_report

        report["worker_before"] = llm.collective_rpc(worker_report)
        dump()
        llm.collective_rpc(reset_peak)   # the report's peak memory is the generation's
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=2)
        # the served prompt alone first, on a fresh cache (too short to fill a block): the batch the
        # server sees, so its tokens must equal these exactly (a batch of 13 may part on near-ties)
        solo = llm.generate([TokensPrompt(prompt_token_ids=ps[SERVED])], sp)[0]
        report["solo_tokens"], report["solo_top2"] = list(solo.outputs[0].token_ids), top2(solo)
        t1 = time.time()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp)
        report["generate_s"] = round(time.time() - t1, 1)
        report["prompt_lens"] = [len(p) for p in ps]
        report["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        report["margins"] = [margins(o) for o in outs]
        report["top2"] = [top2(o) for o in outs]
        report["first_logprobs"] = [
            {str(k): v.logprob for k, v in (o.outputs[0].logprobs[0] or {}).items()} for o in outs]
        # a second pass over the shared-prefix prompts: their prefix blocks are cached now
        t2 = time.time()
        again = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[-3:]], sp)
        report["prefix_pass_s"] = round(time.time() - t2, 1)
        report["prefix_pass_tokens"] = [list(o.outputs[0].token_ids) for o in again]
        report["prefix_pass_margins"] = [margins(o) for o in again]
        report["prefix_pass_top2"] = [top2(o) for o in again]
        report["prefix_pass_cached_tokens"] = [getattr(o, "num_cached_tokens", None) for o in again]
        report["worker_after"] = llm.collective_rpc(worker_report)
        dump()
        if a.mode == "graphs":
            # (e) our kernels inside graph replays: a CUPTI trace over short decodes (batch 4,
            # a captured size) of four of the prompts again (prefix-cached: the steps are decodes)
            sp8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            llm.collective_rpc(profile_start)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[1:5]], sp8)
            report["replay_profile"] = llm.collective_rpc(profile_stop)
            dump()
        if a.serve:
            del llm
            import gc

            gc.collect()
            report["serve"] = serve(a, ps[SERVED], a.max_tokens)
    except BaseException as exc:  # noqa: BLE001
        import traceback

        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["traceback"] = traceback.format_exc()[-6000:]
    report["total_s"] = round(time.time() - t0, 1)
    dump()
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
