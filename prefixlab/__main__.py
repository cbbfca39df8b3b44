"""`python -m prefixlab ...` (and `accelerate launch -m prefixlab run ...`): the `prefixlab` command line."""

import sys

from prefixlab.cli import main

sys.exit(main())
