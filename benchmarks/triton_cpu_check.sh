#!/usr/bin/env bash
# `make check-triton-cpu`: prefixlab's fla and mamba_ssm backends against those packages' real Triton kernels, on a
# machine without a GPU, through Triton's CPU interpreter (TRITON_INTERPRET=1). fp32 only: the interpreter's bf16
# arithmetic is broken (errors of 1e9 where fp32 agrees to 1e-7). Slow (minutes); not part of `make test`.
#
# The packages go into a scratch directory on PYTHONPATH, never into .venv (on a CPU machine with fla installed,
# transformers' hybrid models send CPU tensors to fla). Two edits to those scratch copies make the interpreter run
# them: triton's interpreter turns a one-element array into a loop bound with int(array) (numpy refuses), and fla's
# chunk_delta_h.py calls .to(tl.int64) on a loop index that the interpreter makes a Python int. A third makes the
# interpreter round fp32 operands to TF32 where a kernel asks for TF32, as a GPU does (triton_cpu_site/
# interpreter_tf32.py): fla 0.6's fused triangular solve asks for it on sm80+ GPUs, whatever TRITON_F32_DEFAULT says. mamba_ssm has no
# wheel (its PyPI tarball compiles CUDA extensions): its pure-Python package is used, with a stub for the extension
# its package __init__ imports. The autotuners' timing runs are replaced by a constant (benchmarks/triton_cpu_site).
set -euo pipefail
PY=${PY:-.venv/bin/python}
SCRATCH=${SCRATCH:-/tmp/prefixlab-triton-cpu}
site=$SCRATCH/site mamba=$SCRATCH/mamba
READY="triton-cpu-2"  # what the scratch directory holds; a change in the setup below rebuilds it
if [ "$(cat "$SCRATCH/.ready" 2>/dev/null)" != "$READY" ]; then
    rm -rf "$SCRATCH" && mkdir -p "$site" "$mamba" "$SCRATCH/dl"
    $PY -m pip download --quiet --no-deps -d "$SCRATCH/dl" triton==3.6.0 fla-core==0.6.0 flash-linear-attention==0.6.0 \
        einops
    $PY -m pip install --quiet --no-deps --target "$site" "$SCRATCH"/dl/*.whl
    $PY - "$SCRATCH" <<'EOF'
import json, sys, tarfile, urllib.request
scratch = sys.argv[1]
project = json.load(urllib.request.urlopen("https://pypi.org/pypi/mamba-ssm/json", timeout=60))
url = next(f["url"] for f in project["releases"]["2.3.2.post1"] if f["filename"].endswith(".tar.gz"))
urllib.request.urlretrieve(url, f"{scratch}/dl/mamba_ssm.tar.gz")
with tarfile.open(f"{scratch}/dl/mamba_ssm.tar.gz") as tar:
    members = [m for m in tar.getmembers() if "/mamba_ssm/" in m.name and "/csrc/" not in m.name]
    for member in members:
        member.name = member.name.split("/", 1)[1]
    tar.extractall(f"{scratch}/mamba", members=members, filter="data")
EOF
    echo "# stub: mamba_ssm's package __init__ imports its CUDA extension; only its Triton kernels run here" \
        >"$mamba/selective_scan_cuda.py"
    sed -i 's/lambda self: int(self.handle.data))/lambda self: int(self.handle.data.item()))/' \
        "$site/triton/runtime/interpreter.py"
    sed -i 's/= i_t.to(tl.int64)/= i_t/' "$site/fla/ops/common/chunk_delta_h.py"
    $PY benchmarks/triton_cpu_site/interpreter_tf32.py "$site/triton/runtime/interpreter.py"
    cp benchmarks/triton_cpu_site/sitecustomize.py benchmarks/triton_cpu_site/sm80_fla.py "$site/"
    echo "$READY" >"$SCRATCH/.ready"
fi
export TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee
PYTHONPATH=$site:$mamba $PY benchmarks/triton_cpu_check.py
# transformers' own GatedDeltaNet layers on fla's kernels, prefixlab's torch kernels beside them (as in fp32 on a GPU;
# mamba_ssm stays off this path: with its stub extension transformers' Jamba layers would fail, and its interpreted
# kernels take minutes a case), fla set up as on an sm80+ GPU (its fused solve in TF32, which the edited interpreter
# rounds as a GPU does): tests/conftest.py's IEEE override has to hold for the fp32 comparisons to pass
PYTHONPATH=$site $PY -m pytest -q -p no:warnings -p no:cacheprovider -p sm80_fla tests/test_random_stream.py \
    tests/test_recurrent_cuda.py tests/test_recurrent_cuda_mamba_ssm.py \
    tests/test_numerics.py -k "not bf16"
