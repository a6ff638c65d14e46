"""memsave: gradient checkpointing for TensorFlow 2 graphs."""

import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent

setup(
    name="memsave",
    version="0.1.0",
    description="Drop-in tf.gradients replacement that recomputes activations to save memory",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    packages=find_packages(include=["memsave", "memsave.*"]),
    # TensorFlow comes in flavours (tensorflow, tensorflow-cpu, ...): pick one
    # with an extra, or bring your own.
    install_requires=["numpy", "networkx>=3"],
    extras_require={
        "cpu": ["tensorflow-cpu==2.21.0"],
        "gpu": ["tensorflow==2.21.0"],
        # keras-hub itself is installed without its dependencies (see the
        # Makefile): it requires tensorflow-text, which pulls in the full
        # `tensorflow` beside tensorflow-cpu. These are the ones it imports.
        "test": ["pytest>=7", "hypothesis>=6", "pytest-xdist>=3",
                 "absl-py", "packaging", "regex", "rich", "kagglehub",
                 "kagglesdk==0.1.28", "tokenizers", "sentencepiece"],
        "bench": ["matplotlib>=3.7"],
        # XLA's GPU compiler without a GPU (benchmarks/xla_gpu.py): buffer
        # assignment for an H100 on any machine. No CUDA libraries needed.
        "xla": ["jax==0.10.2", "jaxlib==0.10.2", "jax-cuda12-plugin==0.10.2",
                "jax-cuda12-pjrt==0.10.2"],
    },
    classifiers=[
        "License :: OSI Approved :: MIT License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
