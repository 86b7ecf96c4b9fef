from setuptools import find_packages, setup

setup(
    name="megatron-int8",
    version="0.1.0",
    description="INT8 linear layers (fprop, dgrad, wgrad) for LLM pretraining with megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_int8", "megatron_int8.*"]),
    include_package_data=True,
    package_data={"megatron_int8": ["csrc/*.cu"]},  # built with nvcc on first use (kernels/sm90_gemm.py)
    install_requires=[
        "megatron-core>=0.16.1,<0.20",
        "torch>=2.4",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "psutil",  # megatron-core's dist_checkpointing writer hangs without it
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "triton>=3.0", "matplotlib", "transformers",
                 "safetensors", "protobuf"],
        "hf": ["transformers", "safetensors", "protobuf"],  # scripts/export_hf.py (protobuf: SentencePiece -> tokenizer.json)
        "triton": ["triton>=3.0"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["megatron-int8-pretrain=megatron_int8.pretrain:main"]},
)
