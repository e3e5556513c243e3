"""``dsv4-ops`` (also ``python -m dsv4_ops``): check this machine, run the benchmarks.

  dsv4-ops check   environment, op table, AOT sm_80/86 table, numeric self-test, vLLM serve-path
                   audit; exit 1 on a failure or an open audit row
  dsv4-ops audit-vllm [--against <vLLM wheel or source tree>]  every kernel of vLLM's DeepSeek serve
                   paths on sm_8x; --against: what a vLLM that is not installed breaks
  dsv4-ops bench   the benchmarks (needs a CUDA GPU and a source checkout)
  dsv4-ops doctor  this host against a vLLM deployment (driver, GPUs, /dev/shm, sampler JIT, NVLink, quant layout, Engram, PP, ...)
  dsv4-ops tune    measure the decode plans on this GPU and write its decode table (dsv4_ops.tools.tune)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from typing import Tuple


def _environment() -> str:
    import torch
    import triton

    from .. import __version__, dispatch

    lines = [f"dsv4_ops {__version__}, python {platform.python_version()}, torch {torch.__version__}, "
             f"triton {triton.__version__}"]
    if torch.cuda.is_available():
        cap = dispatch.device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), "
                     f"{dispatch.ENV_VAR}={dispatch.impl_override()}, kernels run: {dispatch.kernel_variant(cap)}")
    else:
        lines.append("GPU: none (CPU: references, fakes, AOT compile, interpreter self-test)")
    return "\n".join(lines)


def cmd_check(args) -> int:
    import torch

    from .. import aot, dispatch, support
    from . import selftest
    from ..registration import op_names

    failures = 0
    print("== environment\n" + _environment())
    caps = list(dispatch.SHOWCASE_CAPABILITIES)
    if torch.cuda.is_available() and dispatch.device_capability() not in caps:
        caps.insert(0, dispatch.device_capability())
    print("\n== op table (capability -> variant; 'runs' is what a direct call runs)")
    print(support.format_table(caps))
    if torch.cuda.is_available():
        for op in op_names():
            ok, reason = support.is_supported(op, "cuda")
            print(f"  this GPU, {op}: {'supported' if ok else 'NOT supported'}: {reason}")
    if not args.skip_aot:
        print("\n== AOT compile for sm_80 / sm_86 (portable variant; no GPU needed)")
        results = aot.check(aot.AMPERE_ARCHS, ("portable",))
        print(aot.format_results(results))
        failures += sum(not r.ok for r in results)
    print("\n== numeric self-test against the references")
    rows = selftest.run()
    print(selftest.format_rows(rows))
    failures += sum(not r["ok"] for r in rows)
    print("\n== vLLM serve-path audit (dsv4-ops audit-vllm)")
    text, failed = _audit_summary(args)
    print(text)
    failures += failed
    print(f"\n{'FAILED: %d check(s)' % failures if failures else 'all checks passed'}")
    return 1 if failures else 0


def _audit_summary(args) -> Tuple[str, int]:
    """(text, failures): the audit's counts for every model it knows and each open row (each a
    failure), a failure when it could not run, or why it was skipped (no vLLM, --skip-audit)."""
    from ..vllm import audit

    if audit.vllm_installed() is None:
        return "vLLM not installed: skipped", 0
    if getattr(args, "skip_audit", False):
        return "skipped (--skip-audit)", 0
    try:
        res = audit.run(audit.ALL_MODELS)
    except Exception as exc:  # noqa: BLE001 - reported as the failure it is
        return f"FAIL: the audit could not run: {exc}"[:600], 1
    opened = res.open_rows()
    lines = [audit.version_line(res), audit.summary_line(res)]
    lines += [f"FAIL: open row {r.ident} ({r.location}): {r.status}: {r.evidence[:160]}" for r in opened]
    return "\n".join(lines), len(opened)


def cmd_audit_vllm(args) -> int:
    """Table of every kernel on vLLM's DeepSeek serve paths on sm_<arch>; exit 1 when a
    default-path row is dead or unknown and not replaced, 2 when vLLM is missing. With
    ``--against``: the same for a vLLM wheel or source tree that is not installed, plus the patch
    table's mismatches and the kernels new or changed since the newest supported release."""
    import json

    from ..vllm import audit

    if args.against and not args.model_given:
        args.model = "all"
    models = {"both": audit.MODELS, "all": audit.ALL_MODELS}.get(args.model, (args.model,))
    if args.against:
        from ..vllm.audit import _against

        try:
            rep = _against.against(args.against, models, arch=args.arch)
        except audit.AuditError as exc:
            print(f"dsv4-ops audit-vllm --against: {exc}")
            return 2
        if args.json:
            print(json.dumps({"vllm": rep.vllm, "release": rep.release, "table": rep.table,
                              "open": [r.__dict__ for r in rep.result.open_rows()],
                              "new": [r.__dict__ for r in rep.kernels.new],
                              "changed": [r.__dict__ for r in rep.kernels.changed],
                              "gone": rep.kernels.removed, "notes": rep.result.notes}, indent=1))
        else:
            print(_against.format_report(rep, details=args.details))
        return 1 if rep.found else 0
    if audit.vllm_installed() is None:
        print("dsv4-ops audit-vllm needs vLLM (pip install 'dsv4-ops[vllm]'); vLLM is not installed.")
        return 2
    res = audit.run(models, arch=args.arch)
    if args.json:
        print(json.dumps({"vllm": res.vllm, "arch": res.arch, "version_note": audit.version_line(res),
                          "rows": [r.__dict__ for r in res.rows], "notes": res.notes}, indent=1))
    else:
        print(audit.version_line(res))
        print(audit.summary_line(res))
        print(audit.format_table(res, models))
        for note in res.notes:
            print("note:", note)
    return 1 if res.open_rows() else 0


def _tune_out() -> str:
    from .tune import DEFAULT_OUT

    return DEFAULT_OUT


def _bench_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(here, "benchmarks")


def cmd_bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("dsv4-ops bench needs a CUDA GPU (sm_80+); this machine has none. On a CPU, run "
              "`dsv4-ops check` (references, AOT sm_80/86, interpreter self-test) instead.")
        return 2
    bench_dir = _bench_dir()
    if not os.path.isdir(bench_dir):
        print(f"dsv4-ops bench runs the scripts of a source checkout; {bench_dir} does not exist. "
              "Clone the repository and install it with `pip install -e .`.")
        return 2
    scripts = sorted(f for f in os.listdir(bench_dir) if f.startswith("bench_") and f.endswith(".py"))
    if args.only:
        scripts = [s for s in scripts if args.only in s]
    rc = 0
    for script in scripts:
        cmd = [sys.executable, os.path.join(bench_dir, script), "--out", args.out] + (["--quick"] if args.quick else [])
        print("$", " ".join(cmd), flush=True)
        rc |= subprocess.run(cmd).returncode
    return rc


def cmd_pp_partition(args) -> int:
    """Legal, most balanced VLLM_PP_LAYER_PARTITION values for a model (pure Python)."""
    from .. import pp_partition

    try:
        print(pp_partition.report(args.config, args.pp))
        if args.check is not None:
            counts = pp_partition.check_partition(args.config, args.check, args.pp)
            print(f"{pp_partition.ENV_VAR}={pp_partition.format_partition(counts)}: legal")
    except (pp_partition.PPPartitionError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if pp_partition.best_partitions(pp_partition.layout_from_config(args.config), args.pp) else 1


def cmd_doctor(args) -> int:
    """One line per deployment check (dsv4_ops.tools.doctor); exit 1 when one fails."""
    from . import doctor

    return doctor.main(args)


def cmd_tune(args) -> int:
    """Measure the paged decode's plans on this GPU, write its decode table (dsv4_ops.tools.tune); 2 on a CPU."""
    from . import tune

    return tune.main(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="environment, op table, AOT sm_80/86, numeric self-test")
    c.add_argument("--skip-aot", action="store_true", help="skip the AOT sm_80/86 compile table")
    c.add_argument("--skip-audit", action="store_true", help="skip the vLLM serve-path audit summary")
    a = sub.add_parser("audit-vllm", help="which kernels of vLLM's DeepSeek serve paths run on sm_8x")
    a.add_argument("--model", choices=("v4", "v41", "both", "v32", "glm5", "all"), default=None,
                   help="both (default): DeepSeek-V4 and V4.1; v32: DeepSeek-V3.2; glm5: GLM-5; all: the four "
                        "(the default with --against)")
    a.add_argument("--arch", type=int, choices=(80, 86), default=80)
    a.add_argument("--json", action="store_true")
    a.add_argument("--against", metavar="WHEEL_OR_TREE", default=None,
                   help="a vLLM wheel (.whl) or unpacked source tree that is not installed: report the patch-table "
                        "rows it breaks, the audit's open rows on it and the kernels new or changed since the "
                        "newest supported release; exit 1 when anything is found")
    a.add_argument("--details", action="store_true", help="with --against: also print the full audit table")
    b = sub.add_parser("bench", help="run the benchmarks (CUDA GPU)")
    b.add_argument("--out", default=os.path.join(_bench_dir(), "results"))
    b.add_argument("--quick", action="store_true")
    b.add_argument("--only", default="", help="run only scripts whose name contains this")
    pp = sub.add_parser("pp-partition", help="legal, most balanced VLLM_PP_LAYER_PARTITION for a model")
    pp.add_argument("config", help="config.json or a model directory holding it")
    pp.add_argument("--pp", type=int, required=True, help="--pipeline-parallel-size")
    pp.add_argument("--check", default=None, metavar="PARTITION", help="also check this partition string")
    dr = sub.add_parser("doctor", help="check this host for a vLLM DeepSeek-V4/V4.1/V3.2 or GLM-5 deployment")
    dr.add_argument("--model", default=None, help="model directory, config.json, or a cached Hugging Face id")
    dr.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    dr.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    dr.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    dr.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    dr.add_argument("--block-size", type=int, default=None, help="the --block-size you will pass to vllm serve")
    dr.add_argument("--kv-cache-dtype", default="auto", help="the --kv-cache-dtype you will pass to vllm serve")
    dr.add_argument("--linear-backend", default="auto", help="the --linear-backend you will pass to vllm serve")
    dr.add_argument("--moe-backend", default="auto", help="the --moe-backend you will pass to vllm serve")
    dr.add_argument("--max-num-batched-tokens", type=int, default=None, help="as for vllm serve (default: vLLM's)")
    dr.add_argument("--max-num-seqs", type=int, default=None, help="as for vllm serve (default: vLLM's)")
    tu = sub.add_parser("tune", help="measure the decode plans on this GPU and write its decode table (minutes)")
    from .. import envs

    tu.add_argument("--out", default=_tune_out(), help=f"directory of the table (point {envs.DECODE_TABLE_DIR} "
                                                       "at it); default %(default)s")
    tu.add_argument("--sms", type=int, default=0, help="run on N SMs of the device (driver green context) and "
                                                       "write the table for N (default: every SM)")
    tu.add_argument("--quick", action="store_true", help="T 1,16,64,128 x H 8,64 at K 640, a 75 s budget")
    tu.add_argument("--shapes", default="", help="T:H:K,... instead of the grid")
    tu.add_argument("--configs", default="", help="configs to measure, comma-separated (default: the dispatched)")
    tu.add_argument("--max-splits", type=int, default=0, help="measure split counts up to N (0: all balanced)")
    tu.add_argument("--replays", type=int, default=20, help="timed graph replays a candidate")
    tu.add_argument("--budget", type=float, default=0.0, help="stop starting shapes after S seconds (0: none; "
                                                              "--quick: 75)")
    args = p.parse_args(argv)
    if args.cmd == "audit-vllm":
        args.model_given = args.model is not None
        args.model = args.model or "both"
    return {"check": cmd_check, "bench": cmd_bench, "audit-vllm": cmd_audit_vllm,
            "pp-partition": cmd_pp_partition, "doctor": cmd_doctor, "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
