#!/usr/bin/env bash
# The GPU checks of one device session, as one script (a GPU machine is lent rarely and briefly):
#   CUDA tests without and with fla, the recurrent kernels, Hydragen at paper scale, `prefixlab run` vs a plain
#   generate loop on a ~0.5 B hybrid. Each step has its own time limit; a failing step does not stop the others.
# Wheels the machine lacks travel in .whl/ (transformers, regex) and .whl/fla/ (fla-core, flash-linear-attention):
#   see benchmarks/RESULTS.md, "GPU". Logs go to $OUT (default /tmp/gpu_check).
# The step limits add up to more than one device call (600 s) and a session's device time (900 s): pick with
#   STEPS, most useful first. Session 26 ran "tests_both capture_overhead bench_hydragen" (425 s; the fla tests did
#   not finish in tests_both's 260 s), then "hit_ttft hydragen_e2e" (161 s), then the fla tests alone (190 s, not
#   finished either: ~47 of 72 tests ran, 4 failed, their names lost). Failures now go to $OUT/failures.log as they
#   happen (tests/conftest.py, PREFIXLAB_FAILURE_LOG). Session 27 ran STEPS="tests_fla_mamba" (290 s: mamba 26
#   passed; fla 88 of 90 ran, 3 random-stream cases failed by fp32 logit differences), then "lse_select
#   bench_hydragen capture_overhead_mamba hydragen_e2e_4b" with HYDRAGEN_BATCHES=1024 HYDRAGEN_FLAGS=--no-packed
#   (239 s), then "fla_fp32_chunking" (its diagnostic hit a test-helper bug, since fixed). The next GPU session:
#     STEPS="fla_fp32_chunking hydragen_sweep" CHUNKING_LIMIT=200 bash benchmarks/gpu_check.sh
#   (carry .whl; timeout_s 400): fla's own fp32 logits when a prompt is cut, as installed and with its fused solve
#   in IEEE (the three failures' cause, found afterwards on the CPU: fla 0.6 hard-codes TF32 there on sm80+ GPUs;
#   tests/conftest.py now sets it to IEEE), and the Hydragen paper's sweep on cuDNN; then the fla tests
#   (step tests_cuda_fla), which should now pass whole.
#   Session 30 ran "tests_fla_mamba hydragen_sweep" (353 s; the sweep done), then the fla files alone with -n 14
#   (96 of 98 finished in 310 s, 0 failed). Next: "fla_fp32_chunking", and the fla files split in two calls
#   (tests_cuda_fla with FLA_TESTS_LIMIT=400) to see them whole.
#   Session 33 (H100) ran STEPS="padded_batch tests_both" TESTS_BOTH_LIMIT=380 FLA_WORKERS=11 (488 s): without fla
#   98 of 98 finished; with fla 95 of 98, 0 failed. pyproject's addopts hold -q, so name tests with -vv. Next:
#     STEPS="padded_batch" bash benchmarks/gpu_check.sh                      (~200 s: where bf16's cached path loses)
#     STEPS="tests_cuda_fla" FLA_TESTS_LIMIT=420 bash benchmarks/gpu_check.sh  (a call of its own: the fla run whole)
#   Session 34 (no GPU) added step decode (~60 s): run it with padded_batch, e.g. STEPS="decode padded_batch".
#   Session 35 (no GPU) primes a batch's rows of one cached prompt in one right-padded forward (was 8): step
#   padded_batch's primes_ms measures it on a GPU (a 0.5 B model's primes are launch-bound there); and a hybrid
#   sibling group's rows prefill in one forward too: step siblings (~40 s). Next: STEPS="padded_batch siblings decode".
# mamba_ssm has no wheel (PyPI has a source tarball that compiles CUDA extensions): its pure-Python package travels
#   in .whl/mamba/ (mamba_ssm/ from the 2.3.2.post1 tarball, plus a stub selective_scan_cuda.py, as its package
#   __init__ imports that extension); prefixlab uses only its Triton kernels (step tests_cuda_mamba).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PREFIXLAB_FAILURE_LOG=$OUT/failures.log
summary=$OUT/summary.log

step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, its tail and status in the summary
    local name=$1 limit=$2
    shift 2
    # STEPS="serve profile" runs only those (the limits add up past one 600-second device call)
    [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $name "* ]] || return 0
    if [[ "$name" == *mamba* && ! -d .whl/mamba/mamba_ssm ]]; then  # (rebuilt by hand: see the header; else skip)
        echo "=== $name skipped: .whl/mamba/mamba_ssm is missing (its import would fail and burn ${limit}s)" >>"$summary"
        return 0
    fi
    echo "=== $name ($(date +%T), limit ${limit}s): $*" >>"$summary"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log" >>"$summary"
    echo "=== $name rc=$rc ($(date +%T))" >>"$summary"
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/fla/*.whl || exit 1
base=/tmp/site:$PWD
{ nvidia-smi -L; PYTHONPATH=$base python3 -c "import torch, transformers, accelerate, triton
print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__,
      'triton', triton.__version__, torch.cuda.get_device_name())"; } >>"$summary" 2>&1

tests="tests/test_recurrent_cuda.py tests/test_recurrent_cuda_mamba_ssm.py tests/test_attention_kernels.py"
tests="$tests tests/test_random_stream.py tests/test_compile.py"
tests="$tests tests/test_numerics.py"
# in order of what matters most, should the machine's time run out (session 22's first run took 525 s; its logs
# showed which steps need which limits)
# 1. without fla: prefixlab's torch kernels on CUDA against transformers' torch layers (session 22: 66 s)
PYTHONPATH=$base PREFIXLAB_TEST_DEVICE=cuda step tests_cuda 120 python3 -m pytest -p no:cacheprovider -q -n 6 \
    -rs $tests
# 0. session 32's priming of a left-padded batch's rows (prefixlab/cache/align.py) on a GPU: primed vs unprimed vs
#    plain generate, fp32 (tokens must match) and bf16, before the tests so nothing shares the GPU with its clock
#    Session 33 (H100): fp32 1.82x plain, bf16 0.94x (unprimed 0.92x): in bf16 the cached path loses to plain at this
#    size; the last run profiles one batch of each kind to find where (primes_ms: the primes' share)
PYTHONPATH=$base step padded_batch 200 sh -c 'cd benchmarks && for d in fp32 bf16; do python3 gpu_padded_batch.py \
    --size small --prefix 4096 --rows 8 --question 32 --rounds 3 --dtype $d; done; python3 gpu_padded_batch.py \
    --size small --prefix 4096 --rows 8 --question 32 --rounds 1 --dtype bf16 --profile 15'
# 0b. a decode step's cost through prefixlab vs plain transformers on the ~0.5 B hybrid (decode_overhead.py): the host
#    time per step is what a GPU waits on at this size (session 34 halved it on the CPU: 1.19-1.24x -> 1.07-1.11x)
PYTHONPATH=$base step decode 120 sh -c 'cd benchmarks && for d in fp32 bf16; do for f in qwen3_5 bamba; do \
    python3 decode_overhead.py --size small --family $f --dtype $d --steps 200; done; done'
# 0c. a hybrid sibling group's prefill (`run --hydragen`): session 35 runs its rows as one right-padded forward
#    (was one forward per row); the ~0.5 B hybrid, 8 rows of a 4,096-token prefix plus 100-128-token questions
PYTHONPATH=$base step siblings 90 sh -c 'cd benchmarks && python3 sibling_prefill.py --size small --prefix 4096'
# 1+4 at once (correctness only, no timings: 16 cores hold both), for a session short of device time
PYTHONPATH=$base step tests_both ${TESTS_BOTH_LIMIT:-260} sh -c "PREFIXLAB_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q -n 5 \
    -rfs --tb=short $tests >$OUT/tests_cuda.log 2>&1 & PYTHONPATH=/tmp/fla:$base PREFIXLAB_TEST_DEVICE=cuda \
    python3 -m pytest -p no:cacheprovider -vv -n ${FLA_WORKERS:-8} --maxfail=8 --tb=short -rfs $tests >$OUT/tests_cuda_fla.log 2>&1;
    wait; tail -n 15 $OUT/tests_cuda.log; grep -v '^E1126' $OUT/tests_cuda_fla.log | tail -n 60"
# 2. issue 11: `prefixlab run` vs a plain generate loop, one GPU, ~0.5 B hybrid, fp32 (session 22: 63 s)
PYTHONPATH=$base step serve 150 python3 benchmarks/serve_accelerate.py --size small --baseline \
    --system-prompts 6 --questions 6 --prompt-tokens 2048 --max-new-tokens 8 --capacity 16GiB \
    --routing affinity --order input,radix --json
#    Session 22: 0.77-0.83x the plain loop; session 23 found the likely cause on the CPU (CUDA decode steps ran the
#    chunked kernel, ~6,000 extra kernel launches a request) and fixed it, and the prefill clock now waits for the GPU
# 3. where prefixlab's requests spend their GPU and host time vs the plain loop's
PYTHONPATH=$base step profile 120 sh -c 'cd benchmarks && python3 profile_serve.py --size small --requests 8'
# 4. with fla: what a CUDA user with the `cuda` extra runs (transformers' layers dispatch to fla too; fla compiles
#    its kernels per shape, slowly). Session 24 read the failures: fla's chunk kernels take fp32 inputs through
#    Triton's default dot precision, TF32, so transformers' own fp32 layers differ from themselves by ~1e-3 across
#    prefill chunkings (tests/conftest.py now asks Triton for IEEE fp32 dots), and importing fla re-registers
#    "mamba2" in transformers' Auto mappings (the test models are now built from transformers' classes by name)
PYTHONPATH=/tmp/fla:$base PREFIXLAB_TEST_DEVICE=cuda step tests_cuda_fla ${FLA_TESTS_LIMIT:-200} python3 -m pytest -p no:cacheprovider \
    -vv -n ${FLA_WORKERS:-14} --tb=short -rfs $tests
# 4+4b at once (correctness only; 16 cores compile both sets of Triton kernels), the whole fla run in one call
PYTHONPATH=$base step tests_fla_mamba ${FLA_TESTS_LIMIT:-300} sh -c "PYTHONPATH=$PWD/.whl/mamba:$base \
    PREFIXLAB_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q -n 4 --tb=short -rfs \
    tests/test_recurrent_cuda_mamba_ssm.py tests/test_random_stream.py tests/test_numerics.py \
    -k 'mamba or bamba or nemotron or zamba or falcon or granite' >$OUT/tests_cuda_mamba.log 2>&1 & \
    PYTHONPATH=/tmp/fla:$base PREFIXLAB_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q -n 12 \
    --tb=short -rfs $tests >$OUT/tests_cuda_fla.log 2>&1; wait; grep -v '^E1126' $OUT/tests_cuda_mamba.log | \
    tail -n 25; grep -v '^E1126' $OUT/tests_cuda_fla.log | tail -n 60"
# 4c. session 27's fla run failed three random-stream cases (OLMo-hybrid by 2.2e-3): the models' own fp32 logits
#     with fla, one forward vs two, against float64 without fla (no prefixlab code), alongside the stream's other
#     cases with fla, one line per finished test (-v)
PYTHONPATH=$base step fla_fp32_chunking ${CHUNKING_LIMIT:-200} sh -c "PYTHONPATH=/tmp/fla:$base \
    PREFIXLAB_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -v -n 12 --tb=short -rfs \
    tests/test_random_stream.py -k 'not (olmo_hybrid or qwen3_5_moe_text or qwen3_next)' \
    >$OUT/tests_stream_fla.log 2>&1 & python3 benchmarks/gpu_fla_fp32_chunking.py --out $OUT --reference && \
    for s in '' --ieee-solve; do PYTHONPATH=/tmp/fla:$base python3 benchmarks/gpu_fla_fp32_chunking.py --out $OUT \
    \$s && python3 benchmarks/gpu_fla_fp32_chunking.py --out $OUT --compare; done; wait; \
    grep -E 'PASSED|FAILED|ERROR|passed|failed' $OUT/tests_stream_fla.log | tail -n 40"
# 4b. mamba_ssm's Triton SSD kernels (never run on a GPU before session 26's code): prefixlab's mamba_ssm backend
#     (one pass for a sequence, segments for a batch) and the Mamba2 families served with it (not Jamba: with the
#     stub extension, transformers' Jamba layers would call mamba_ssm's CUDA selective scan, which is not there)
PYTHONPATH=$PWD/.whl/mamba:$base PREFIXLAB_TEST_DEVICE=cuda step tests_cuda_mamba 150 python3 -m pytest \
    -p no:cacheprovider -q -n 6 --tb=short -rfs tests/test_recurrent_cuda_mamba_ssm.py tests/test_random_stream.py \
    tests/test_numerics.py -k "mamba or bamba or nemotron or zamba or falcon or granite"
# 5. the recurrent kernels at Qwen3.5's shapes: fla (bf16) with captures, each result printed when measured
PYTHONPATH=/tmp/fla:$base step bench_recurrent_fla 90 python3 -m prefixlab bench recurrent --device cuda \
    --dtype bf16 --backend fla --length ${FLA_LENGTH:-8192} --repeats 10 --json
# 5b. issue 12's capture target (8 states in a 32K prefill, <= 3%): one pass vs the segment driver, and their states
PYTHONPATH=/tmp/fla:$base step capture_overhead 90 python3 benchmarks/gpu_capture_overhead.py --length 32768
PYTHONPATH=$PWD/.whl/mamba:$base step capture_overhead_mamba 60 python3 benchmarks/gpu_capture_overhead.py \
    --kernel mamba_ssm --length 32768 --heads 80 --dim 64
# 6. Hydragen at paper scale (decode over a long shared prefix; compiled flex with LSE on CUDA), then split's kernels
#    and phases (benchmarks/gpu_lse_kernels.py). No TORCH_LOGS=recompiles any more: session 24's run with it timed
#    split at 8.0 ms, twice session 22's 4.0 ms without it on the same split code (not isolated further); the log
#    had shown three flex graphs (the level call, the suffix call with a dynamic batch, packed's), no more
#    Session 27: first every kernel prefixlab's CUDA calls can use, at split's two call shapes (B = 1024), the fastest
#    correct one per call kind exported as PREFIXLAB_LSE_KERNELS for the steps after it; bench_hydragen then times
#    split with the defaults and with that choice
PYTHONPATH=$base step lse_select 90 python3 benchmarks/gpu_lse_kernels.py --batch ${LSE_BATCH:-1024} --prefix 16384
chosen=$(tail -n 1 "$OUT/lse_select.log" 2>/dev/null | python3 -c "import json, sys
try: print(json.loads(sys.stdin.read())['setting'])
except Exception: pass")
[ -n "$chosen" ] && export PREFIXLAB_LSE_KERNELS=$chosen && echo "PREFIXLAB_LSE_KERNELS=$chosen" >>"$summary"
PYTHONPATH=$base step bench_hydragen 150 sh -c 'for s in "" ${PREFIXLAB_LSE_KERNELS:-}; do
    PREFIXLAB_LSE_KERNELS=$s python3 -m prefixlab bench hydragen --device cuda --dtype bf16 \
        --batch ${HYDRAGEN_BATCHES:-64,256,512,1024} --prefix 16384 --suffix 256 --q-heads 32 --kv-heads 8 \
        ${HYDRAGEN_FLAGS:-} --json; done'
# 6b. the Hydragen paper's figure: speed-up vs batch for several prefix lengths, one process, on the default kernels
PYTHONPATH=$base step hydragen_sweep 150 python3 -m prefixlab bench hydragen --device cuda --dtype bf16 \
    --batch 16,64,256,1024 --prefix 2048,4096,8192,16384 --suffix 256 --q-heads 32 --kv-heads 8 --no-packed \
    --json --plot $OUT/hydragen_sweep.png
PYTHONPATH=$base step lse_kernels 60 python3 benchmarks/gpu_lse_kernels.py --batch 512 --prefix 16384
# 7. the compiled torch path on CUDA (fp32; compiles take a while)
PYTHONPATH=$base step bench_recurrent_compiled 90 python3 -m prefixlab bench recurrent --device cuda \
    --backend compiled --length 8192 --repeats 10 --json
# 8. Hydragen end to end (issue 12's item): N sampled completions of one long prompt, standard generate (N copies of
#    the prompt's KV) vs Hydragen generate vs the no-attention ceiling, tiny Llama-shaped model (8:1 heads, d=128),
#    bf16, then Qwen3.5-shaped in fp32 (where the tokens should match)
PYTHONPATH=$base step hydragen_e2e 150 sh -c 'python3 -m prefixlab bench hydragen --e2e --dtype bf16 \
    --completions 256 --prompt 16384 --new-tokens 32 --json; python3 -m prefixlab bench hydragen --e2e \
    --model qwen3_5 --completions 64 --prompt 4096 --new-tokens 32 --json'
#    Session 26: 0.88x (tiny Llama) and 0.49x (tiny Qwen3.5) standard generate, ceilings 1.6x / 1.27x: tiny models
#    spend a decode step outside attention. Issue 12 asks for a real size: a ~4 B Qwen3.5-shaped hybrid in bf16 with
#    fla for its GatedDeltaNet layers (64 x 16K: the standard cache holds ~34 GB of KV)
PYTHONPATH=/tmp/fla:$base step hydragen_e2e_4b 240 python3 -m prefixlab bench hydragen --e2e --model qwen3_5_4b \
    --dtype bf16 --completions 64 --prompt 16384 --new-tokens 32 --json
# 9. hit TTFT at a 32K cached prefix, 64-token suffix, against the suffix-only floor (issue 12's item: <= 1.2x), on
#    serve's ~0.5 B hybrid in fp32 and bf16
PYTHONPATH=$base step hit_ttft 150 sh -c 'cd benchmarks && for d in fp32 bf16; do python3 gpu_hit_ttft.py \
    --size small --prefix 32768 --suffix 64 --rounds 10 --dtype $d; done'
[ -s "$OUT/failures.log" ] && grep -v "^E1126" "$OUT/failures.log" | tail -n 150 >>"$summary"
echo "done $(date +%T)" >>"$summary"
