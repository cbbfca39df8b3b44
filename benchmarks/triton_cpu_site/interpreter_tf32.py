"""Scratch edit for `make check-triton-cpu` (run once on the scratch copy of triton/runtime/interpreter.py): the
interpreter's dot product ignores `input_precision`; a GPU's tensor cores round fp32 operands to TF32 (10 mantissa
bits) when a kernel asks for TF32, so the edited interpreter does the same. Kernels that hard-code TF32 (fla 0.6's
fused triangular solve) then show on a CPU what they do on a GPU."""

import sys
from pathlib import Path

ANCHOR = "        return TensorHandle(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)\n"
EDIT = '''        precision = str(input_precision).lower()
        if "tf32" in precision and "x3" not in precision and a_data.dtype == np.float32:
            # round to nearest even at 10 mantissa bits, as tensor cores read fp32 operands for TF32
            def tf32(x):
                bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
                bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
                return bits.view(np.float32)
            a_data, b_data = tf32(a_data), tf32(b_data)
'''

path = Path(sys.argv[1])
text = path.read_text()
if EDIT not in text:
    if text.count(ANCHOR) != 1:
        sys.exit(f"{path}: the interpreter's dot product is not where this edit expects it (another triton?)")
    path.write_text(text.replace(ANCHOR, EDIT + ANCHOR))
