from setuptools import setup

# The three source folders install as one package tree (README, "Layout"): csrc_triton/ and
# registration/ become dsv4_ops.csrc_triton and dsv4_ops.registration. Every package folder is
# listed (tests/test_packaging.py checks that none is missing from a wheel install).
setup(
    packages=["dsv4_ops", "dsv4_ops.csrc_triton", "dsv4_ops.csrc_triton.decode", "dsv4_ops.dispatch",
              "dsv4_ops.registration", "dsv4_ops.tools", "dsv4_ops.vllm", "dsv4_ops.vllm.audit",
              "dsv4_ops.vllm.serve_graph"],
    # the shipped per-device decode tables (dsv4_ops.dispatch.tables reads them beside the package)
    package_data={"dsv4_ops": ["tables/*.json"], "dsv4_ops.vllm.audit": ["inventory/*.json"]},
    package_dir={
        "dsv4_ops": "dsv4_ops",
        "dsv4_ops.csrc_triton": "csrc_triton",
        "dsv4_ops.registration": "registration",
    },
)
