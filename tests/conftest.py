import os

import pytest

from prefixlab.data import shared_file

# On a CUDA machine with fla installed, transformers' own fp32 GatedDeltaNet layers run fla's Triton kernels, whose
# fp32 dots default to TF32: the model without prefixlab then differs from itself by ~1e-3 in the logits when the
# same prompt is prefilled in other chunks (measured on an H200, session 24), so no 1e-5 comparison could hold.
# IEEE fp32 dots make the reference an fp32 reference; an explicit TRITON_F32_DEFAULT is left as given.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def require_shared(relative: str):
    """Path of a shared data file, or skip the test with a clear reason."""
    path = shared_file(relative)
    if path is None:
        pytest.skip(f"../shared/data/{relative} not present (set PREFIXLAB_SHARED_DATA to run this test)")
    return path
