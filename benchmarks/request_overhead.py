"""Host time a store spends per request outside the model's forward, on the CPU.

    python benchmarks/request_overhead.py begin --layers 32        # HybridPrefixCache.begin per request
    python benchmarks/request_overhead.py explain --namespaces 10001  # explain.why on a hit, many namespaces

`begin`: a Qwen3.5-shaped model of `--layers` layers (3 GatedDeltaNet : 1 attention, tiny widths: the host work of
a request grows with the number of modules, not their size) serves 60 one-new-token requests on a cached 64-token
prompt; prints the median CPU time of `begin` (the per-request checks, the lookup, loading the states) over the
last 50. `explain`: `--namespaces` namespaces each hold a shared 512-token template and one question; prints the
median time of the reason code of a new question's hit (the `other_namespace` check). Run it on two code trees
(`PYTHONPATH=<worktree>`) alternately to compare them."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import _COMMON, _GDN  # noqa: E402
from prefix_helpers import request, tiny_spec  # noqa: E402

import prefixlab.cache.hf as hf  # noqa: E402
from prefixlab import HybridPrefixCache, PrefixStore  # noqa: E402
from prefixlab.cache.core import PrefixCacheCore  # noqa: E402
from prefixlab.cache.explain import why  # noqa: E402


def begin_ms(layers: int) -> float:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    config = tf.Qwen3_5TextConfig(**{**_COMMON, "hidden_size": 32, "intermediate_size": 32}, num_hidden_layers=layers,
                                  **{**_GDN, "layer_types": layer_types})
    model = tf.Qwen3_5ForCausalLM(config).eval()
    store, spent, original = PrefixStore(model, capacity="1GB", policy="dp"), [], hf.HybridPrefixCache.begin

    def timed(self, *args, **kwargs):
        start = time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent.append(time.process_time() - start)

    hf.HybridPrefixCache.begin = timed
    prompt = torch.randint(3, 128, (1, 64))
    with torch.no_grad():
        for i in range(60):
            ids = torch.cat([prompt, torch.tensor([[3 + i % 100]])], 1)
            model.generate(ids, past_key_values=HybridPrefixCache(store), max_new_tokens=1, do_sample=False)
    hf.HybridPrefixCache.begin = original
    store.close()
    return 1e3 * statistics.median(spent[10:])


def explain_ms(namespaces: int) -> float:
    rng = np.random.default_rng(0)
    core, template = PrefixCacheCore(10**12, "dp", tiny_spec(), block_size=16), rng.integers(3, 30000, 512)
    for i in range(namespaces):
        request(core, template, namespace=f"t{i}")
        request(core, np.concatenate([template, rng.integers(3, 30000, 32)]), namespace=f"t{i}")
    times = []
    for i in range(200):
        tokens = np.concatenate([template, rng.integers(3, 30000, 32)])
        match = core.match(tokens, f"t{i % namespaces}")
        start = time.perf_counter()
        reason = why(core, tokens, match)
        times.append(time.perf_counter() - start)
        core.release(match)
    assert reason == "hit", reason
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["begin", "explain"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--namespaces", type=int, default=10001)
    args = parser.parse_args()
    if args.what == "begin":
        print(f"begin, {args.layers} layers: median {begin_ms(args.layers):.2f} ms CPU per request")
    else:
        print(f"explain, {args.namespaces} namespaces: median {explain_ms(args.namespaces):.3f} ms per hit")


if __name__ == "__main__":
    main()
