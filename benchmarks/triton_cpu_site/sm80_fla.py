"""pytest plugin for `make check-triton-cpu` (`-p sm80_fla`): fla's kernels as fla sets them up on an sm80+ GPU, where
its fused triangular solve computes in TF32 (`SOLVE_TRIL_DOT_PRECISION`; the interpreter has no TF32, so fla picks
IEEE there). Loaded before tests/conftest.py, whose IEEE override must then bring the fp32 references back."""

import triton.language as tl
from fla.ops.gated_delta_rule import chunk_fwd
from fla.ops.kda import chunk_intra

chunk_fwd.SOLVE_TRIL_DOT_PRECISION = chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("tf32")
