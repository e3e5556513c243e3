"""CI runs the whole suite on the newest supported vLLM and only the `vllm_release` tests on the
others (.ci/run): a test file that imports vLLM itself must be release-marked, as a whole
(conftest.VLLM_RELEASE_FILES) or test by test (@pytest.mark.vllm_release). Files that reach
vLLM only through dsv4_ops.vllm are listed by hand there; this guards the direct imports."""

import pathlib
import re

from conftest import VLLM_RELEASE_FILES

TESTS = pathlib.Path(__file__).parent
IMPORTS_VLLM = re.compile(r"^\s*(from vllm[ .]|import vllm\b)", re.M)


def test_every_file_importing_vllm_is_release_marked():
    unmarked = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("test_*.py"))
                if IMPORTS_VLLM.search(p.read_text()) and p.name not in VLLM_RELEASE_FILES
                and "pytest.mark.vllm_release" not in p.read_text()]
    assert not unmarked, f"import vLLM but run on one release only: {unmarked} (tests/conftest.py VLLM_RELEASE_FILES)"


def test_the_release_files_exist():
    names = {p.name for p in TESTS.rglob("test_*.py")}
    assert VLLM_RELEASE_FILES <= names, sorted(VLLM_RELEASE_FILES - names)
