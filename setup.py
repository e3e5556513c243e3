from setuptools import setup

# The three source folders install as one package tree (DESIGN.md, "Layers").
setup(
    packages=["dsv4_ops", "dsv4_ops.csrc_triton", "dsv4_ops.registration", "dsv4_ops.vllm"],
    package_dir={
        "dsv4_ops": "dsv4_ops",
        "dsv4_ops.csrc_triton": "csrc_triton",
        "dsv4_ops.registration": "registration",
    },
)
