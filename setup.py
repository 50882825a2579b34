"""specdec: speculative decoding and speculative cascades in JAX/Flax."""

import os

from setuptools import find_packages, setup


def _shipped_files(*folders: str) -> list[tuple[str, list[str]]]:
  """data/ and configs/ under <prefix>/share/specdec/, where `specdec.data.shipped` finds them after a
  non-editable install."""
  files = []
  for folder in folders:
    for directory, _, names in sorted(os.walk(folder)):
      if names:
        files.append((os.path.join("share", "specdec", directory), sorted(os.path.join(directory, n) for n in names)))
  return files


setup(
    name="specdec",
    version="0.1.0",
    description="Speculative decoding, speculative cascades, SpecTr, CS Drafting and SpecDec++ in JAX",
    packages=find_packages(include=["specdec", "specdec.*"]),
    # the commands' options, read before JAX is imported; the CPU kernel's source, compiled on first use
    package_data={"specdec.cli": ["registry.json"], "specdec.models": ["cpu_kernel.cc"]},
    python_requires=">=3.11",   # the pinned etils[epath] (constraints.txt) requires it
    data_files=_shipped_files("data", "configs"),
    entry_points={"console_scripts": [
        f"specdec-{name}=specdec.cli.{name}:console" for name in ("generate", "sweep", "plot", "train", "plan", "bench")]},
    # What the package imports, and all that `make quickstart` installs; the extras below are for the tests
    # and the seqio tasks only.
    install_requires=[
        "etils[epath]>=1.5",  # local and gs:// paths for checkpoints and exports
        "flax>=0.10",
        "gguf>=0.17",         # GGUF checkpoints (llama.cpp's format): SmolLM2, any Llama-family file
        "gin-config>=0.5",
        "jinja2>=3.1",        # chat templates of instruct models (rendered in a sandbox)
        "jax>=0.4.30",
        "lz4>=4",
        "matplotlib>=3.8",
        "numpy>=1.26",
        "optax>=0.2",
        "orbax-checkpoint>=0.11",
        "rouge-score>=0.1.2",
        "sacrebleu>=2.4",
        "safetensors>=0.4",   # Hugging Face T5 checkpoints (specdec.training.load_hf_t5)
        "scipy>=1.11",
        "sentencepiece>=0.2",
        "tokenizers>=0.20",   # byte-level BPE tokenizers from GGUF metadata
        "tqdm>=4.60",
    ],
    extras_require={
        # torch/transformers: the independent T5 and Gemma 2 implementations the import tests compare with;
        # seqio (with TensorFlow and tfds): the seqio tasks and the few-shot benchmarks on tfds's mock data.
        # torch==2.13.0 is the CPU build on the machines' local index; a bare "torch" pulls CUDA packages.
        # libtpu: TPU programs compiled on this CPU (specdec-plan; Linux x86-64 wheels only, elsewhere its
        # tests are skipped with the reason).
        # accelerate: transformers' GGUF loader needs it (the SmolLM2 reference).
        "test": ["pytest>=8", "torch==2.13.0", "transformers>=4.45", "accelerate>=1.0", "seqio>=0.0.20",
                 "libtpu; sys_platform == 'linux' and platform_machine == 'x86_64'"],
        "tpu-plan": ["libtpu; sys_platform == 'linux' and platform_machine == 'x86_64'"],
        # seqio/tfds tasks and the seqio vocabulary adapter (TensorFlow, ~800 MB download)
        "seqio": ["seqio>=0.0.20"],
    },
)
