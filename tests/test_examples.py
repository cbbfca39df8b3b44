"""The README's runnable examples run and their reuse is exact (they assert identical tokens themselves)."""

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


def test_the_image_example_reuses_a_repeated_image_and_skips_its_encoder():
    out = subprocess.run([sys.executable, str(EXAMPLE.parent / "images.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("image")]
    assert len(lines) == 5 and all("identical tokens" in line for line in lines)
    # the third question about image 0 reuses past the image (218 = system prompt + delimiters + 16 image tokens);
    # a repeated image is never encoded again
    assert "reused 218 of 230" in lines[3] and lines[3].endswith("vision tower runs: 0")
    assert lines[1].endswith("vision tower runs: 0") and lines[2].endswith("vision tower runs: 1")
