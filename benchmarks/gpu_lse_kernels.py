"""Attention-with-LSE kernels for Hydragen's split path on CUDA, at the shapes of its two calls (a shared level's
folded queries over the long prefix, each sequence's queries over its suffix): time and error of each candidate.

Session 22 measured split at 4 ms for B=512, P=16,384 on an H200 where its work needs well under 1 ms
(benchmarks/RESULTS.md, GPU). Candidates: every kernel prefixlab's CUDA path can be set to (`CUDA_LSE_KERNELS`:
one compiled FlexAttention for both calls, cuDNN's and FlashAttention-2's fused kernels through ATen, two batched
GEMMs), plus one compiled FlexAttention per call site and ATen's memory-efficient kernel. Every candidate is checked
against the float32 reference; one JSON line each, then split's phases, then the fastest correct kernel for each
call kind as a `PREFIXLAB_LSE_KERNELS` setting (the last line).

    python benchmarks/gpu_lse_kernels.py --batch 1024 --prefix 16384 --suffix 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from prefixlab.attention.kernels import CUDA_LSE_KERNELS, attention_with_lse_reference

SITE_KIND = {"level": "long", "suffix": "short"}  # which of prefixlab's call kinds each of split's calls is
OUT_TOLERANCE, LSE_TOLERANCE = 2e-2, 1e-2  # bf16 rounding of outputs of magnitude ~1; the LSE is float32


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


def aten_efficient(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, scale=scale)[:2]
    return out, lse[..., : q.shape[2]]  # the kernel pads the LSE's query axis


def flex_per_site():
    """One compiled FlexAttention per call site (prefixlab's "flex" shares one between both sites)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    compiled = torch.compile(flex_attention)

    def run(q, k, v, mask, scale):
        out, aux = compiled(q, k, v, scale=scale, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return run


def choose(rows: list[dict]) -> dict:
    """The fastest kernel prefixlab can be set to (`PREFIXLAB_LSE_KERNELS`) for each call kind, among those within
    bf16 rounding of the float32 reference; the site-to-kind map is `SITE_KIND`."""
    best = {}
    for site, kind in SITE_KIND.items():
        fit = [r for r in rows if r["kernel"] in CUDA_LSE_KERNELS and f"{site}_ms" in r
               and r[f"{site}_out_error"] <= OUT_TOLERANCE and r[f"{site}_lse_error"] <= LSE_TOLERANCE]
        if fit:
            best[kind] = min(fit, key=lambda r: r[f"{site}_ms"])["kernel"]
    return {"chosen": best, "setting": ",".join(f"{kind}={name}" for kind, name in best.items())}


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
    candidates = {name: {site: kernel for site in calls} for name, kernel in CUDA_LSE_KERNELS.items()}
    candidates["flex_per_site"] = {site: flex_per_site() for site in calls}
    candidates["aten_efficient"] = {site: aten_efficient for site in calls}
    rows = []
    for name, kernels in candidates.items():
        row = {"kernel": name, "batch": args.batch, "prefix": args.prefix, "suffix": args.suffix}
        try:
            for site, tensors in calls.items():
                out, lse = kernels[site](*tensors, None, scale)
                ref_out, ref_lse = references[site]
                row[f"{site}_out_error"] = (out.float() - ref_out.float()).abs().max().item()
                row[f"{site}_lse_error"] = (lse.float() - ref_lse.float()).abs().max().item()
            # interleaved as split runs them (level then suffix), the pair timed together and each alone
            row["pair_ms"] = best_ms(lambda k=kernels: [k[s](*calls[s], None, scale) for s in calls], args.repeats)
            for site in calls:
                row[f"{site}_ms"] = best_ms(lambda k=kernels[site], s=site: k(*calls[s], None, scale), args.repeats)
        except Exception as err:  # a candidate this torch / GPU cannot run: report it, go on with the others
            row["error"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps(split_phases(args)), flush=True)
    print(json.dumps(choose(rows)), flush=True)  # last line: read by gpu_check.sh
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
