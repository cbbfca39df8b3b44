"""`prefixlab` command line: each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixlab.errors import PrefixlabError

# subcommand -> module defining `register(subparsers)`, which adds it with `set_defaults(func=...)`. Only the module
# of the subcommand being run is imported: `bench` pulls in torch and transformers, `simulate` needs neither.
SUBCOMMAND_MODULES = {
    "simulate": "prefixlab.sim.cli",
    "trace": "prefixlab.sim.cli",
    "demo": "prefixlab.demo",
    "bench": "prefixlab.bench",
    "run": "prefixlab.fleet.run",
}


class ArgumentParser(argparse.ArgumentParser):
    """Usage errors are one `prefixlab: error: ...` line (exit 2); subcommand parsers inherit this class."""

    def error(self, message: str):
        print(f"prefixlab: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def seed_int(text: str) -> int:
    """argparse type: a random seed, an int in [0, 2**63)."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s subcommands, or with all of them when `command` is None or unknown."""
    parser = ArgumentParser(prog="prefixlab", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = SUBCOMMAND_MODULES.values()
    if command in SUBCOMMAND_MODULES:
        modules = [SUBCOMMAND_MODULES[command]]
    for name in dict.fromkeys(modules):
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PrefixlabError as err:
        print(f"prefixlab: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
