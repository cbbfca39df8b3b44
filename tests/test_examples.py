"""The README's runnable example runs and its reuse is exact (it asserts identical tokens itself)."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_runs_and_reuses_the_shared_prefix():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "identical tokens" in out.stdout
    # the second request resumes from one of dp's prior states (256), the third after the 300-token system prompt
    assert "'reused_tokens': 556" in out.stdout
