"""`prefixlab` command line: each subcommand lives beside the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixlab.errors import PrefixlabError

# module path -> it defines `register(subparsers)` adding its subcommand(s) with `set_defaults(func=...)`.
SUBCOMMAND_MODULES = (
    "prefixlab.sim.cli",  # simulate, trace build
    "prefixlab.demo",  # demo
    "prefixlab.bench",  # bench hydragen | recurrent
)


class ArgumentParser(argparse.ArgumentParser):
    """Usage errors are one `prefixlab: error: ...` line (exit 2); subcommand parsers inherit this class."""

    def error(self, message: str):
        print(f"prefixlab: error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="prefixlab", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PrefixlabError as err:
        print(f"prefixlab: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
