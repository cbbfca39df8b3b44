"""State capture inside the CUDA packages' prefill pass vs the segment driver (issue 12: 8 states in a 32K prefill,
<= 3%).

Times, interleaved, best of each: the package's kernel returning the final state only; the same call capturing the
states from its own chunk states (prefixlab's fla / mamba_ssm backend); and the segment driver (one call per segment
between capture positions, each captured state a final state in fp32: exact by construction). Also reports how far
the one-pass states are from the segment driver's (the one-pass path reads the package's chunk states, which it
keeps in the inputs' dtype) and from the fp32 torch reference. One JSON line.

    python benchmarks/gpu_capture_overhead.py --length 32768 --captures 8                  # fla, Qwen3.5's shapes
    python benchmarks/gpu_capture_overhead.py --kernel mamba_ssm --heads 80 --dim 64       # Mamba2-2.7B's shapes
"""

from __future__ import annotations

import argparse
import json
from unittest import mock

import torch

from prefixlab.bench.recurrent import best_times_s, spread_positions
from prefixlab.recurrent import cuda
from prefixlab.recurrent.delta_rule import gated_delta_rule
from prefixlab.recurrent.inputs import delta_rule_inputs, ssd_inputs
from prefixlab.recurrent.ssd import ssd


def max_state_diff(a: dict, b: dict) -> float:
    return max((a[p].float() - b[p].float()).abs().max().item() for p in a)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--captures", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kernel", default="fla", choices=("fla", "mamba_ssm"))
    parser.add_argument("--state-size", type=int, default=128, help="mamba_ssm: SSM state size")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (it times the CUDA packages' kernels)")
    positions = spread_positions(args.length, args.captures)
    if args.kernel == "fla":
        inputs = {name: t.cuda().to(torch.bfloat16) for name, t in
                  delta_rule_inputs(1, args.length, args.heads, args.heads, args.dim, args.dim).items()}

        def run(capture=(), backend="fla"):
            return gated_delta_rule(**inputs, capture=capture, use_qk_l2norm=True, backend=backend)

        def segmented():
            with mock.patch.object(cuda, "tap_fla_chunk_states", lambda: False):
                return run(positions)
    else:
        inputs = {name: t.cuda().to(torch.bfloat16) for name, t in
                  ssd_inputs(1, args.length, args.heads, args.dim, 1, args.state_size).items()}

        def run(capture=(), backend="mamba_ssm", **given):
            return ssd(**(inputs | given), capture=capture, backend=backend)

        def segmented():  # what the segment driver does for a batch
            bounds, state, states = (0, *positions, args.length), None, {}
            for start, stop in zip(bounds, bounds[1:], strict=False):
                piece = {n: inputs[n][:, start:stop] for n in ("x", "dt", "B", "C")}
                _, state, _ = run(initial_state=state, **piece)
                states[stop] = state
            return None, state, {p: states[p] for p in positions}

    times = best_times_s({"final_only": run, "one_pass": lambda: run(positions), "segments": segmented},
                         args.repeats)
    one_pass, segments = run(positions)[2], segmented()[2]
    inputs = {n: t.float() for n, t in inputs.items()}
    reference = run(positions, backend="torch")[2]
    print(json.dumps({
        "bench": f"{args.kernel}_capture_overhead", "length": args.length, "captures": args.captures,
        "heads": args.heads, "dim": args.dim, "gpu": torch.cuda.get_device_name(),
        "ms": {k: v * 1e3 for k, v in times.items()},
        "one_pass_overhead": times["one_pass"] / times["final_only"] - 1,
        "segments_overhead": times["segments"] / times["final_only"] - 1,
        "state_max_diff_one_pass_vs_segments": max_state_diff(one_pass, segments),
        "state_max_diff_one_pass_vs_fp32_reference": max_state_diff(one_pass, reference),
        "state_max_diff_segments_vs_fp32_reference": max_state_diff(segments, reference),
        "state_max_abs": max(s.abs().max().item() for s in reference.values()),
    }))


if __name__ == "__main__":
    main()
