"""Packaging for megatron-elaswave.

The top-level ``patches/`` folder (everything that touches Megatron-Core internals) is installed as
the sub-package ``megatron_elaswave.patches``.
"""

from setuptools import find_packages, setup

# The Megatron-Core releases the patches were checked against; megatron_elaswave.patches refuses
# any other version at import time with a clear message.
MEGATRON_CORE = "megatron-core>=0.16.1,<0.20"
# Kept equal to megatron_elaswave.patches.torch_version.MINIMUM_TORCH (a test compares them).
TORCH = "torch>=2.12"

setup(
    name="megatron-elaswave",
    version="0.1.0",
    description="Elastic-native hybrid-parallel training for Megatron-Core: survive rank failures "
    "without restart or disk checkpoint.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_elaswave", "megatron_elaswave.*"])
    + ["megatron_elaswave.patches"],
    package_dir={"megatron_elaswave.patches": "patches"},
    install_requires=[
        # The oldest torch with every torch API the project uses: new_group(sort_ranks=...) came
        # in 2.12 (GroupName in 2.10, ProcessGroup.set_timeout in 2.9, ProcessGroup.abort in 2.7).
        # No upper bound, so that pip keeps the torch a container already has; at start-up
        # megatron_elaswave.patches.torch_version names any API that the installed torch lacks.
        TORCH,
        MEGATRON_CORE,
        "numpy>=1.26",
        # dist_checkpointing's async writer needs psutil but megatron-core does not declare it.
        "psutil>=5.9",
        # Each worker's process title names its rank and script (megatron_elaswave/launch/proctitle.py).
        "setproctitle>=1.3",
    ],
    extras_require={
        # matplotlib: the plots of scripts/reproduce.py, whose --smoke run is part of CI;
        # etcd3gw: the tests of the job store on etcd (tests/test_etcd.py).
        "test": ["pytest>=8", "hypothesis>=6", "matplotlib>=3.8", "etcd3gw>=2.4"],
        # elaswave-run --store etcd://...: etcd's v3 API through its gRPC gateway.
        "etcd": ["etcd3gw>=2.4"],
        # --tensorboard-dir and --wandb-project (W&B's offline mode needs no account).
        "logging": ["tensorboard>=2.14", "wandb>=0.16"],
        # torchft 0.2 publishes wheels for Linux x86_64 only (elsewhere pip builds it from
        # source, which needs Rust and protoc); scripts/bench/torchft_mttr.py uses 0.2's API.
        "bench": ["matplotlib>=3.8", "torchft>=0.2,<0.3"],
        "cuda": ["transformer-engine[pytorch]"],
        "npu": ["torch-npu"],
        "dvfs": ["nvidia-ml-py"],
    },
    entry_points={"console_scripts": ["elaswave-run=megatron_elaswave.launch.run:main"]},
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
