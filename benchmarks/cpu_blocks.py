"""The chunked kernels whole (one block) vs in the CPU blocks of `_chunks.cpu_blocks`: interleaved, this process's
CPU seconds on one thread, best of 3; prints each ratio and the largest difference of outputs and final states.

    .venv/bin/python benchmarks/cpu_blocks.py
"""

import time

import torch

from prefixlab.recurrent import _chunks, gated_delta_rule, ssd
from prefixlab.recurrent.inputs import delta_rule_inputs, ssd_inputs


def compare(name: str, run, repeats: int = 3) -> None:
    default = _chunks.CPU_BLOCK_BYTES

    def whole():
        _chunks.CPU_BLOCK_BYTES = 1 << 60
        try:
            return run()
        finally:
            _chunks.CPU_BLOCK_BYTES = default

    fns = {"whole": whole, "blocked": run}
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.process_time()
            fn()
            best[key] = min(best[key], time.process_time() - start)
    diff = max((a - b).abs().max().item() for a, b in zip(whole()[:2], run()[:2], strict=True))
    print(f"{name}: whole {1e3 * best['whole']:.0f} ms, blocked {1e3 * best['blocked']:.0f} ms, "
          f"{best['whole'] / best['blocked']:.2f}x, max diff {diff:.1e}", flush=True)


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    for batch, length in ((1, 4096), (1, 16384), (4, 4096)):
        delta = delta_rule_inputs(batch, length, 16, 16, 128, 128)
        compare(f"delta rule B={batch} T={length} H=16 K=V=128",
                lambda delta=delta: gated_delta_rule(**delta, use_qk_l2norm=True, backend="compiled"))
        scan = ssd_inputs(batch, length, 32, 64, 1, 128)
        compare(f"ssd B={batch} T={length} H=32 P=64 N=128",
                lambda scan=scan: ssd(**scan, chunk_size=256, backend="compiled"))


if __name__ == "__main__":
    main()
