"""`make bench`'s setup for every benchmark."""

import logging

import torch

if not torch.cuda.is_available():
    # transformers' hybrid layers advise installing causal_conv1d / flash-linear-attention / mamba_ssm for their
    # "optimized kernel": CUDA-only packages, which on a CPU machine make those layers crash (README), and their torch
    # paths are what these benchmarks compare against there. On a CPU the advice is noise in `make bench -s`.
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
