"""Helpers of the CLI tests (test_sim_cli.py, test_trace_cli.py): only the sim subcommands, one-line errors."""

import pytest

import prefixlab.cli


@pytest.fixture(autouse=True)
def only_sim_subcommands(monkeypatch):
    """Register only this module's subcommands: the test must not depend on other modules' CLIs."""
    sim_only = {"simulate": "prefixlab.sim.cli", "trace": "prefixlab.sim.cli"}
    monkeypatch.setattr(prefixlab.cli, "SUBCOMMAND_MODULES", sim_only)


def run(capsys, *argv):
    code = prefixlab.cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(capsys, *argv, match):
    code, out, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("prefixlab: error: ") and match in lines[0], lines[0]
    return lines[0]
