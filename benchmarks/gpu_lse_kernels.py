"""Attention-with-LSE kernels for Hydragen's split path on CUDA, at the shapes of its two calls (a shared level's
folded queries over the long prefix, each sequence's queries over its suffix): time and error of each candidate.

Session 22 measured split at 4 ms for B=512, P=16,384 on an H200 where its work needs well under 1 ms
(benchmarks/RESULTS.md, GPU). Candidates: prefixlab's current path (one compiled FlexAttention serving both calls),
one compiled FlexAttention per call site, and ATen's flash and memory-efficient kernels (both return the LSE).
Every candidate is checked against the float32 reference; one JSON line each.

    python benchmarks/gpu_lse_kernels.py --batch 512 --prefix 16384 --suffix 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from prefixlab.attention.kernels import attention_with_lse_reference


def best_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def flex_with_lse(compiled):
    from torch.nn.attention.flex_attention import AuxRequest

    def run(q, k, v, scale):
        out, aux = compiled(q, k, v, scale=scale, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return run


def aten_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    return out, lse


def aten_efficient(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # the kernel pads the LSE's query axis


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_lse_kernels: needs a CUDA device (these kernels are CUDA's)", file=sys.stderr)
        return 2
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    group, dim = args.q_heads // args.kv_heads, args.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    # the folded shapes of prefixlab/attention/split.py: equal head counts, GQA groups in the query axis
    calls = {"level": (rand(1, args.kv_heads, args.batch * group, dim), rand(1, args.kv_heads, args.prefix, dim),
                       rand(1, args.kv_heads, args.prefix, dim)),
             "suffix": (rand(args.batch, args.kv_heads, group, dim), rand(args.batch, args.kv_heads, args.suffix, dim),
                        rand(args.batch, args.kv_heads, args.suffix, dim))}
    scale = dim**-0.5
    references = {site: attention_with_lse_reference(*tensors, None, scale) for site, tensors in calls.items()}
    shared = flex_with_lse(torch.compile(flex_attention))
    candidates = {"flex_shared": {site: shared for site in calls},  # prefixlab's path today
                  "flex_per_site": {site: flex_with_lse(torch.compile(flex_attention)) for site in calls},
                  "aten_flash": {site: aten_flash for site in calls},
                  "aten_efficient": {site: aten_efficient for site in calls}}
    for name, kernels in candidates.items():
        row = {"kernel": name, "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix}
        try:
            for site, tensors in calls.items():
                out, lse = kernels[site](*tensors, scale)
                ref_out, ref_lse = references[site]
                row[f"{site}_out_error"] = (out.float() - ref_out.float()).abs().max().item()
                row[f"{site}_lse_error"] = (lse.float() - ref_lse.float()).abs().max().item()
            # interleaved as split runs them (level then suffix), the pair timed together and each alone
            row["pair_ms"] = best_ms(lambda k=kernels: [k[s](*calls[s], scale) for s in calls], args.repeats)
            for site in calls:
                row[f"{site}_ms"] = best_ms(lambda k=kernels[site], s=site: k(*calls[s], scale), args.repeats)
        except Exception as err:  # a candidate this torch / GPU cannot run: report it, go on with the others
            row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        print(json.dumps(row), flush=True)
    print(json.dumps(split_phases(args)), flush=True)
    return 0


def split_phases(args: argparse.Namespace) -> dict:
    """Where `hydragen_attention(method="split")` spends its time at these shapes: each phase with the GPU waited for
    (`*_ms`), and the whole call's host time alone (`split_host_ms`: launches, guards, Python; no wait at the end)."""
    from prefixlab.attention.api import hydragen_attention
    from prefixlab.attention.kernels import compiled_combine
    from prefixlab.attention.split import level_partial, suffix_partial
    from prefixlab.attention.tree import SharedLevel, plan_tree

    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    dim = args.head_dim
    q = rand(args.batch, args.q_heads, 1, dim)
    level = SharedLevel(rand(args.kv_heads, args.prefix, dim), rand(args.kv_heads, args.prefix, dim))
    suffix_k, suffix_v = rand(args.batch, args.kv_heads, args.suffix, dim), rand(args.batch, args.kv_heads,
                                                                                  args.suffix, dim)
    scale = dim**-0.5
    parts = [level_partial(q, level.keys, level.values, scale), suffix_partial(q, suffix_k, suffix_v, None, scale)]
    outs, lses = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    phases = {"plan": lambda: plan_tree(q, [level], suffix_k, suffix_v),
              "level": lambda: level_partial(q, level.keys, level.values, scale),
              "suffix": lambda: suffix_partial(q, suffix_k, suffix_v, None, scale),
              "combine": lambda: compiled_combine()(outs, lses),
              "split": lambda: hydragen_attention(q, [level], suffix_k, suffix_v, method="split")}
    row = {"phases_of": "split", "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix}
    row.update({f"{name}_ms": best_ms(fn, args.repeats) for name, fn in phases.items()})
    host = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        phases["split"]()
        host.append((time.perf_counter() - start) * 1e3)
    row["split_host_ms"] = min(host)
    return row


if __name__ == "__main__":
    sys.exit(main())
