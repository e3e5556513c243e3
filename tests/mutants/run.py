"""Mutation check of the test suite: plant each bug of tests/mutants/mutants.py in a temporary
copy of the repository and run that mutant's test selection there; a failing selection catches
the mutant. Never edits the working tree. Not a pytest module (CI's default run skips it).

    python tests/mutants/run.py                       # every mutant, a table at the end
    python tests/mutants/run.py --only NAME [NAME..]  # some of them
    python tests/mutants/run.py --only NAME --tests "tests/x.py -k y"   # another selection
    python tests/mutants/run.py --baseline            # the selections on the unmutated copy first
    python tests/mutants/run.py --list                # names, files, selections

The copy holds the files git tracks or would add (``git ls-files -co --exclude-standard``);
``dsv4_ops`` is imported from it (PYTHONPATH, and links for the package folders setup.py maps:
csrc_triton -> dsv4_ops.csrc_triton, registration -> dsv4_ops.registration), never from the
editable install. Exit status 0 when every mutant was caught (and the baseline passed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from mutants import MUTANTS, Mutant  # noqa: E402

MAPPED = {"csrc_triton": "dsv4_ops/csrc_triton", "registration": "dsv4_ops/registration"}


def make_copy(dest: str) -> None:
    """The repository's files (tracked and addable) under ``dest``, plus the package links."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue  # deleted in the working tree
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
    for folder, link in MAPPED.items():
        os.symlink(os.path.join("..", folder), os.path.join(dest, link))  # relative: copies of the copy keep theirs


def apply(m: Mutant, root: str) -> str:
    """Plant ``m`` in the copy at ``root``; '' or why it cannot (stale row)."""
    path = os.path.join(root, m.file)
    if not os.path.exists(path):
        return f"stale: {m.file} does not exist"
    text = open(path, encoding="utf-8").read()
    n = text.count(m.old)
    if n != 1:
        return f"stale: the text to replace occurs {n} times in {m.file}"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(m.old, m.new))
    return ""


def pytest_env(root: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_pytest(root: str, selection, timeout: int):
    """(returncode, seconds, output) of ``pytest -x -q`` on ``selection`` inside the copy."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rf", *selection]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=root, env=pytest_env(root), capture_output=True, text=True, timeout=timeout)
        return proc.returncode, time.time() - t0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, time.time() - t0, out + f"\n(timed out after {timeout} s)"


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].split(" ", 1)[1]
    return ""


def check_imports_from(root: str) -> None:
    """The copy's dsv4_ops (and its mapped kernels) are the ones a test imports."""
    probe = ("import dsv4_ops, dsv4_ops.csrc_triton.engram as k, dsv4_ops.registration as r; "
             "print(dsv4_ops.__file__); print(k.__file__); print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, env=pytest_env(root), capture_output=True,
                         text=True, check=True).stdout.split()
    real = os.path.realpath(root)
    bad = [p for p in out if not os.path.realpath(p).startswith(real)]
    if bad:
        raise SystemExit(f"the copy's package is not the one imported: {bad}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="mutants to run (default: all)")
    ap.add_argument("--tests", help="a selection replacing the mutants' own (one string, shell-split)")
    ap.add_argument("--baseline", action="store_true", help="first run the selections on the unmutated copy")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per selection (default 1800)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies (paths printed)")
    args = ap.parse_args(argv)

    chosen = list(MUTANTS)
    if args.only:
        names = {m.name for m in MUTANTS}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            ap.error(f"unknown mutants {unknown}; --list shows them")
        chosen = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.file:40s} {' '.join(m.tests)}")
        return 0
    override = shlex.split(args.tests) if args.tests else None

    base = tempfile.mkdtemp(prefix="dsv4_mutants_")
    pristine = os.path.join(base, "pristine")
    make_copy(pristine)
    check_imports_from(pristine)
    status = 0
    if args.baseline:
        # -k expressions cannot be merged: each distinct selection runs once
        seen = set()
        for m in chosen:
            sel = tuple(override or m.tests)
            if sel in seen:
                continue
            seen.add(sel)
            rc, secs, out = run_pytest(pristine, sel, args.timeout)
            print(f"baseline {' '.join(sel)}: {'passed' if rc == 0 else 'FAILED (rc %d)' % rc} ({secs:.0f} s)",
                  flush=True)
            if rc != 0:
                print(out[-3000:])
                status = 2
    rows = []
    for m in chosen:
        work = os.path.join(base, m.name)
        shutil.copytree(pristine, work, symlinks=True)
        why = apply(m, work)
        sel = override or list(m.tests)
        if why:
            rows.append(dict(mutant=m.name, file=m.file, result="stale", test=why, seconds=0.0, later=m.later))
        else:
            rc, secs, out = run_pytest(work, sel, args.timeout)
            if rc == 1:
                result, test = "caught", first_failure(out)
            elif rc == 0:
                result, test = "SURVIVED", " ".join(sel)
            else:  # collection error, usage error, nothing selected, timeout: not a catch
                result, test = f"error (rc {rc})", (first_failure(out) or out.strip().splitlines()[-1:] or [""])[0]
            rows.append(dict(mutant=m.name, file=m.file, result=result, test=test, seconds=round(secs, 1),
                             later=m.later))
        r = rows[-1]
        print(f"{r['mutant']:34s} {r['result']:9s} {r['seconds']:6.0f} s  {r['test']}", flush=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        print(f"copies kept under {base}")

    print("\n| mutant | file | result | test that caught it (or the selection) | seconds |")
    print("|---|---|---|---|---|")
    for r in rows:
        note = f" (expected: {r['later']})" if r["result"] != "caught" and r["later"] else ""
        print(f"| {r['mutant']} | {r['file']} | {r['result']}{note} | {r['test']} | {r['seconds']:.0f} |")
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} caught")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return status or (0 if caught == len(rows) else 1)


if __name__ == "__main__":
    sys.exit(main())
