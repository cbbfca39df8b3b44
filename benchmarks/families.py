"""Every hybrid family the store serves, on one workload: a shared system prompt and questions after it, through
`generate` over a PrefixStore against the same weights without prefixlab (tiny random-init models at the tests'
unit weight scale, where a wrong state shows in the logits; CPU fp32).

Per family it prints the share of prompt tokens reused, whether every greedy token matched, the largest fp32 logit
difference, and the CPU time of the cached loop over the uncached one (requests alternated, so both see the same
machine load). Tiny models are mostly host time: the time column says what prefixlab's bookkeeping costs there, not
what reuse saves on a real model (see benchmarks/test_bench_hf.py for that).

    python benchmarks/families.py [--families a,b] [--system 96] [--questions 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_models import cache_argument  # noqa: E402
from recurrent_patch_models import CONFIGS, build, tokens  # noqa: E402

from prefixlab import HybridPrefixCache, PrefixStore  # noqa: E402


def run(model: torch.nn.Module, ids: torch.Tensor, cache=None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Greedy tokens, their logits and the CPU seconds of one generate call."""
    kwargs = {} if cache is None else {cache_argument(model): cache}
    start = time.process_time()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits), time.process_time() - start


def measure(family: str, system_tokens: int, questions: int) -> dict:
    model, reference = build(family, seed=3), build(family, seed=3)
    store = PrefixStore(model, capacity="256MB", policy="dp")
    system = tokens(1, system_tokens, seed=1)
    prompt_tokens = reused = 0
    identical, worst, cached_s, plain_s = True, 0.0, 0.0, 0.0
    try:
        for q in range(questions):
            ids = torch.cat([system, tokens(1, 16, seed=10 + q)], dim=1)
            cache = HybridPrefixCache(store)
            got, got_logits, seconds = run(model, ids, cache)
            want, want_logits, plain = run(reference, ids)
            cached_s, plain_s = cached_s + seconds, plain_s + plain
            prompt_tokens, reused = prompt_tokens + ids.shape[1], reused + cache.reused_tokens
            identical &= torch.equal(got, want)
            worst = max(worst, (got_logits - want_logits).abs().max().item())
    finally:
        store.close()
    return dict(family=family, prompt_tokens=prompt_tokens, reused_tokens=reused,
                token_hit_rate=reused / prompt_tokens, tokens_identical=identical, max_logit_diff=worst,
                cpu_time_ratio=cached_s / plain_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(sorted(CONFIGS)), help="comma-separated (default: all)")
    parser.add_argument("--system", type=int, default=96, help="system prompt tokens")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--json", action="store_true", help="one JSON object per family")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| family | prompt tokens reused | greedy tokens identical | max fp32 logit diff | CPU time cached / plain |")
    print("|---|---|---|---|---|")
    for family in args.families.split(","):
        row = measure(family, args.system, args.questions)
        if args.json:
            print(json.dumps(row))
        else:
            print(f"| {family} | {row['reused_tokens']} / {row['prompt_tokens']} ({row['token_hit_rate']:.1%}) | "
                  f"{'yes' if row['tokens_identical'] else 'NO'} | {row['max_logit_diff']:.1e} | "
                  f"{row['cpu_time_ratio']:.2f} |")


if __name__ == "__main__":
    main()
