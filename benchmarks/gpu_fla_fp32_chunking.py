"""How far a model's own fp32 logits move when its prompt runs in two forwards instead of one, with transformers'
GatedDeltaNet / KDA layers on fla's Triton kernels (IEEE fp32 dots), against a float64 reference without fla.

A prefix cache resumes a prompt from a stored state: the model then runs the prompt in two forwards. Session 27's
CUDA run with fla failed three random-stream cases by 1.1e-5, 2.7e-5 and 2.2e-3 (OLMo-hybrid, whose beta reaches 2)
against the one-forward run; on the CPU the cause showed (Triton's interpreter rounding TF32 as a GPU does): fla 0.6
computes its fused triangular solve in TF32 on sm80+ GPUs whatever TRITON_F32_DEFAULT says. This measures it on a
GPU without prefixlab code: fla as installed, and with `--ieee-solve` (tests/conftest.py's override). Two processes
(fla changes transformers' kernels at import):

    PYTHONPATH=<fla>:... python3 benchmarks/gpu_fla_fp32_chunking.py --out DIR [--ieee-solve]  # fp32, fla
    PYTHONPATH=...       python3 benchmarks/gpu_fla_fp32_chunking.py --out DIR --reference     # float64, torch
    python3 benchmarks/gpu_fla_fp32_chunking.py --out DIR --compare
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # as tests/conftest.py: fp32 dots in fp32, not TF32
DEVICE = os.environ.get("PREFIXLAB_TEST_DEVICE", "cuda")

FAMILIES = ("olmo_hybrid", "qwen3_5_moe_text", "qwen3_next", "qwen3_5_text", "kimi_linear")  # fla-served layers
SPLITS = (4, 9, 16, 21)
LENGTH, BATCH = 24, 3


def logits(family: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import recurrent_patch_models as models

    model = models.build(family, seed=3).to(device=DEVICE, dtype=dtype)
    if dtype == torch.float64 and getattr(model.config, "num_experts", 0):
        model.set_experts_implementation("eager")  # grouped_mm has no float64
    ids = models.tokens(BATCH, LENGTH, seed=11).to(DEVICE)
    result = {"one": models.forward(model, ids).double().cpu()}
    for split in SPLITS:
        cache = models.new_cache(model)
        head = models.forward(model, ids[:, :split], cache)
        tail = models.forward(model, ids[:, split:], cache, start=split)
        result[f"split{split}"] = torch.cat([head, tail], dim=1).double().cpu()
    # left padding (the failing OLMo-hybrid request had a padded row): one forward, and two split at 16
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    result["pad_one"] = models.forward(model, ids, attention_mask=mask).double().cpu()
    cache = models.new_cache(model)
    head = models.forward(model, ids[:, :16], cache, attention_mask=mask[:, :16])
    tail = models.forward(model, ids[:, 16:], cache, start=16, attention_mask=mask)
    result["pad_split16"] = torch.cat([head, tail], dim=1).double().cpu()
    return result


def compare(out: Path) -> None:
    fla, ref = torch.load(out / "fla.pt"), torch.load(out / "reference.pt")
    for family in FAMILIES:
        if family not in fla or family not in ref:
            print(json.dumps({"family": family, "missing": True}))
            continue
        one, exact = fla[family]["one"], ref[family]["one"]
        row = {"family": family, "fla_solve": fla.get("solve"), "logit_max_abs": exact.abs().max().item(),
               "one_vs_float64": (one - exact).abs().max().item()}
        for split in SPLITS:
            two = fla[family][f"split{split}"]
            row[f"split{split}_vs_one"] = (two - one).abs().max().item()
            row[f"split{split}_vs_float64"] = (two - exact).abs().max().item()
        pad_one, pad_two, pad_exact = fla[family]["pad_one"], fla[family]["pad_split16"], ref[family]["pad_one"]
        row["pad_one_vs_float64"] = (pad_one - pad_exact)[:, 2:].abs().max().item()  # pad rows' logits: no meaning
        row["pad_split16_vs_one"] = (pad_two - pad_one)[:, 2:].abs().max().item()
        row["pad_split16_vs_float64"] = (pad_two - pad_exact)[:, 2:].abs().max().item()
        print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", action="store_true", help="float64 without fla (run without fla on the path)")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--ieee-solve", action="store_true", help="fla's fused solve in IEEE fp32 (as the tests)")
    args = parser.parse_args()
    if args.compare:
        compare(args.out)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.ieee_solve:
        from cuda_packages import force_fla_ieee_solve

        print(json.dumps({"ieee_solve": force_fla_ieee_solve()}), flush=True)
    results = {"solve": "ieee" if args.ieee_solve else "as installed"}
    for family in FAMILIES:
        try:
            results[family] = logits(family, torch.float64 if args.reference else torch.float32)
        except Exception as error:  # noqa: BLE001 - reported; the other families go on
            print(json.dumps({"family": family, "error": f"{type(error).__name__}: {error}"[:300]}), flush=True)
    torch.save(results, args.out / ("reference.pt" if args.reference else "fla.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
