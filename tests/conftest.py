import os

import pytest
import torch
from cuda_packages import force_fla_ieee_solve

from prefixlab.data import absent, shared_file

# On a CUDA machine with fla installed, transformers' own fp32 GatedDeltaNet layers run fla's Triton kernels, whose
# fp32 dots default to TF32: the model without prefixlab then differs from itself by ~1e-3 in the logits when the
# same prompt is prefilled in other chunks (measured on an H200, session 24), so no 1e-5 comparison could hold.
# IEEE fp32 dots make the reference an fp32 reference; an explicit TRITON_F32_DEFAULT is left as given.
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
# ... and fla's fused triangular solve hard-codes TF32 on sm80+ GPUs (tests/cuda_packages.py): IEEE there too,
# wherever fla's kernels run (a GPU, or Triton's CPU interpreter in `make check-triton-cpu`)
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    force_fla_ieee_solve()


def require_shared(relative: str):
    """Path of a shared data file, or skip the test with a clear reason."""
    if reason := absent(relative):
        pytest.skip(reason)
    return shared_file(relative)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """PREFIXLAB_FAILURE_LOG=FILE appends each failure (test id and traceback) to FILE as it happens: a GPU run that
    its time limit kills before pytest's summary still says what failed (with xdist this runs on the controller)."""
    path = os.environ.get("PREFIXLAB_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
