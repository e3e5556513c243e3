"""A wheel install must carry every package folder: setup.py lists them by hand (package_dir
maps csrc_triton/ and registration/ into dsv4_ops), so a new subpackage that is not listed
would work in an editable checkout and be missing for `pip install dsv4-ops`."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"dsv4_ops": ROOT / "dsv4_ops", "dsv4_ops.csrc_triton": ROOT / "csrc_triton",
           "dsv4_ops.registration": ROOT / "registration"}


def listed_packages():
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no packages= list")


def on_disk_packages():
    found = set()
    for pkg, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            if pkg == "dsv4_ops" and rel and rel[0] in ("csrc_triton", "registration"):
                continue
            found.add(".".join((pkg,) + rel))
    return found


def test_every_package_folder_is_in_setup_py():
    missing = on_disk_packages() - listed_packages()
    assert not missing, f"add to setup.py packages=: {sorted(missing)}"


def test_the_vllm_extra_is_the_supported_range():
    """pyproject's `vllm` extra admits exactly the releases dsv4_ops.vllm.versions declares."""
    import tomllib

    from packaging.requirements import Requirement

    from dsv4_ops.vllm import versions

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["vllm"]]
    assert req.name == "vllm" and str(req.specifier) == str(Requirement("vllm" + versions.PIP_RANGE).specifier)
    for v in versions.SUPPORTED:
        assert req.specifier.contains(v)
    older = versions.SUPPORTED[0].rsplit(".", 2)[0] + "." + str(int(versions.SUPPORTED[0].split(".")[1]) - 1) + ".0"
    newer = "0." + str(int(versions.NEWEST_DIFFED.split(".")[1]) + 1) + ".0"
    assert not req.specifier.contains(older) and not req.specifier.contains(newer)
    assert not any(r.startswith("vllm") for r in extras["test"])  # CI installs vLLM with tools.install_vllm
