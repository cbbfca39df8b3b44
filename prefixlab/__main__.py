"""`python -m prefixlab ...` (and `accelerate launch -m prefixlab run ...`): the `prefixlab` command line."""

from prefixlab.cli import main
from prefixlab.fleet.launch import exit_process

exit_process(main())
