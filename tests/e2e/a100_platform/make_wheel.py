"""Build this test-only distribution's wheel without a build backend (the CPU venv has no
``wheel`` package): the package files plus a dist-info whose entry points are read from
pyproject.toml (their one home). ``pip install --no-deps --target DIR <wheel>`` then installs it.

    python tests/e2e/a100_platform/make_wheel.py OUT_DIR   -> prints the wheel's path
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import zipfile

try:
    import tomllib
except ImportError:   # Python 3.10: pip's vendored parser
    from pip._vendor import tomli as tomllib

HERE = os.path.dirname(os.path.abspath(__file__))


def build(out_dir: str) -> str:
    meta = tomllib.load(open(os.path.join(HERE, "pyproject.toml"), "rb"))["project"]
    name, version = meta["name"].replace("-", "_"), meta["version"]
    dist = f"{name}-{version}.dist-info"
    files = {}
    for pkg in ("dsv4_e2e_a100",):
        for fn in sorted(os.listdir(os.path.join(HERE, pkg))):
            if fn.endswith(".py"):
                files[f"{pkg}/{fn}"] = open(os.path.join(HERE, pkg, fn), "rb").read()
    eps = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(entries.items())) + "\n"
                  for group, entries in meta["entry-points"].items())
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {version}\nSummary: {meta['description']}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: make_wheel.py\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{dist}/entry_points.txt"] = eps.encode()
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},{len(d)}\n"
                     for p, d in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, d in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2020, 1, 1, 0, 0, 0)), d)
    return path


if __name__ == "__main__":
    print(build(sys.argv[1]))
