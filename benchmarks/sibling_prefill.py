"""The prefill of a hybrid sibling group (`prefixlab run --hydragen`, prefixlab/fleet/siblings.py): rows of a primed
prefix plus questions of close lengths, served by `generate_group`; its time to the first token, per round.

    python benchmarks/sibling_prefill.py --size tiny                 # CPU, the demo's tiny hybrid
    python benchmarks/sibling_prefill.py --size small --prefix 256   # the ~0.5 B hybrid

Each round serves fresh questions; the first round's outputs are checked against the uncached model and not
timed. One JSON line: the group's prefill milliseconds per timed round, their median, the right pads computed.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from serve_accelerate import SIZES
from transformers import Qwen3_5ForCausalLM

import prefixlab.attention  # noqa: F401 (registers attn_implementation="hydragen")
from prefixlab import PrefixStore
from prefixlab.demo import tiny_hybrid_config
from prefixlab.fleet import serve, siblings

VOCAB = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--prefix", type=int, default=1024, help="the primed prefix's tokens")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--question", type=int, nargs=2, default=(100, 128), help="question tokens: min max")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one checked round)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Qwen3_5ForCausalLM(tiny_hybrid_config(VOCAB, **SIZES[args.size])).to(device).eval()
    model.set_attn_implementation("hydragen")
    store = PrefixStore(model, capacity="4GiB")
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, VOCAB - 1, args.prefix)
    new = [args.new_tokens] * args.rows
    milliseconds, identical = [], None
    with torch.inference_mode():
        serve.prime(model, store, prefix)
        for round_ in range(args.rounds + 1):
            lengths = rng.integers(args.question[0], args.question[1] + 1, args.rows)
            rows = [np.concatenate([prefix, rng.integers(3, VOCAB - 1, n)]) for n in lengths]
            result = siblings.generate_group(model, store, rows, args.prefix, new)
            if round_ == 0:
                reference = [serve.generate_uncached(model, row, n) for row, n in zip(rows, new, strict=True)]
                identical = result.outputs == reference
            else:
                milliseconds.append(round(result.prefill_seconds * 1e3, 1))
    print(json.dumps({"size": args.size, "device": device, "rows": args.rows, "prefix": args.prefix,
                      "prefill_ms": milliseconds, "median_ms": sorted(milliseconds)[len(milliseconds) // 2],
                      "padding_tokens": result.padding_tokens, "outputs_identical": identical}))


if __name__ == "__main__":
    main()
