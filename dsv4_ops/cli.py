"""``dsv4-ops`` (also ``python -m dsv4_ops``): check this machine, run the benchmarks.

  dsv4-ops check   environment, op table, AOT sm_80/86 table, numeric self-test; exit 1 on a failure
  dsv4-ops bench   the benchmarks (needs a CUDA GPU and a source checkout)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys


def _environment() -> str:
    import torch
    import triton

    from . import __version__, dispatch

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

    from . import aot, dispatch, selftest

    failures = 0
    print("== environment\n" + _environment())
    caps = list(dispatch.SHOWCASE_CAPABILITIES)
    if torch.cuda.is_available() and dispatch.device_capability() not in caps:
        caps.insert(0, dispatch.device_capability())
    print("\n== op table (capability -> variant; 'runs' is what a direct call runs)")
    print(dispatch.format_table(caps))
    if torch.cuda.is_available():
        for op in dispatch.OPS:
            ok, reason = dispatch.is_supported(op, "cuda")
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
    print(f"\n{'FAILED: %d check(s)' % failures if failures else 'all checks passed'}")
    return 1 if failures else 0


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv4-ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="environment, op table, AOT sm_80/86, numeric self-test")
    c.add_argument("--skip-aot", action="store_true", help="skip the AOT sm_80/86 compile table")
    b = sub.add_parser("bench", help="run the benchmarks (CUDA GPU)")
    b.add_argument("--out", default=os.path.join(_bench_dir(), "results"))
    b.add_argument("--quick", action="store_true")
    b.add_argument("--only", default="", help="run only scripts whose name contains this")
    args = p.parse_args(argv)
    return {"check": cmd_check, "bench": cmd_bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
