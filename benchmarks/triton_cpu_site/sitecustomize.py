"""Loaded by Python at start-up from benchmarks/triton_cpu_check.sh's scratch PYTHONPATH only: lets fla's and
mamba_ssm's Triton kernels run under Triton's CPU interpreter on a machine without a GPU."""

try:  # autotuners time their configs on a GPU: take the first config instead
    import triton.runtime.autotuner as _autotuner

    _autotuner.Autotuner._bench = lambda self, *args, config=None, **meta: [0.0, 0.0, 0.0]
except ImportError:
    pass

try:  # mamba_ssm's launchers enter torch.cuda.device(tensor.device.index): a no-op for CPU tensors
    import torch as _torch

    class _NoDevice:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    if not _torch.cuda.is_available():
        _torch.cuda.device = _NoDevice
except ImportError:
    pass
