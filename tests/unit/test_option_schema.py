"""Issue 45, one schema for the options: each option's default is written once, in
``hpcadapt.base.options``; the flags take theirs from there (no ``default=`` for an option in
``hpcadapt/args.py``), and the flags declared elsewhere (a policy's parameter, a strategy's
setting) agree with it."""

import argparse
import ast
import os

import hpcadapt
from conftest import ROOT
from hpcadapt.base.options import FLAGLESS_OPTIONS, FailureOptions, option_defaults


def _parser():
    return hpcadapt.add_arguments(argparse.ArgumentParser())


def test_every_flag_of_an_option_defaults_to_the_schemas_value():
    defaults = option_defaults()
    parsed = vars(_parser().parse_args([]))
    flagged = {name for name in defaults if name in parsed}
    # every option but the three that other flags fill has a flag of its own name
    assert set(defaults) - flagged == set(FLAGLESS_OPTIONS)
    assert {name: parsed[name] for name in flagged} == {name: defaults[name] for name in flagged}


def test_args_writes_no_default_of_an_option():
    defaults = option_defaults()
    tree = ast.parse(open(os.path.join(ROOT, "hpcadapt", "args.py"), encoding="utf-8").read())
    written = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            dest = next((k.value.value for k in node.keywords if k.arg == "dest"
                         and isinstance(k.value, ast.Constant)), None)
            if dest is None:
                flags = [a.value for a in node.args if isinstance(a, ast.Constant)
                         and str(a.value).startswith("--")]
                dest = flags[0][2:].replace("-", "_") if flags else None
            if dest in defaults and any(k.arg == "default" for k in node.keywords):
                written.append(f"line {node.lineno}: {dest}")
    assert written == []


def test_the_peer_watch_floor_is_the_options_default():
    from hpcadapt.comm.world import PEER_TIMEOUT_FLOOR

    assert PEER_TIMEOUT_FLOOR == FailureOptions.peer_timeout == 30.0


def test_a_users_parser_keeps_its_own_flags_and_gets_the_options_defaults():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    hpcadapt.add_arguments(parser)
    args = parser.parse_args(["--peer-timeout", "12"])
    assert args.epochs == 3 and args.peer_timeout == 12.0 and args.join_timeout == 120.0


def _numeric_parsers(path=None, *, source=None):
    """The functions of ``path`` (or of ``source``) that turn a flag's text into a number
    themselves (``int(text)`` or ``float(text)`` inside a ``try``)."""
    tree = ast.parse(source if source is not None else open(path, encoding="utf-8").read())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Try) and any(
                    isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                    and c.func.id in ("int", "float") and c.args
                    and isinstance(c.args[0], ast.Name) and c.args[0].id == "text"
                    for stmt in node.body for c in ast.walk(stmt)):
                found.append(fn.name)
                break
    return found


def test_every_numeric_flag_is_parsed_in_one_place():
    """Issue 45: one numeric parser. The flags of the command line, the policies'
    parameters and the strategies' settings all parse through ``hpcadapt.base.parsers``;
    ``hpcadapt.policies.params`` is its names (the same functions), not a copy."""
    from hpcadapt.base import parsers
    from hpcadapt.policies import params

    elsewhere = {}
    for top in ("hpcadapt", "policies"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and not path.endswith(os.path.join("base",
                                                                           "parsers.py")):
                    found = _numeric_parsers(path)
                    if found:
                        elsewhere[os.path.relpath(path, ROOT)] = found
    assert elsewhere == {}
    # the reader finds the shape of the old twins (strategies' parse_float was one)
    assert _numeric_parsers(source="def parse_float(text):\n    try:\n        return "
                            "float(text)\n    except ValueError:\n        raise\n") == \
        ["parse_float"]
    # and in parsers.py one function converts text and says what was expected
    tree = ast.parse(open(parsers.__file__, encoding="utf-8").read())
    converting = [fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                  and any(isinstance(node, ast.Try) for node in ast.walk(fn))]
    assert converting == ["_converted"]
    assert all(getattr(params, n) is getattr(parsers, n) for n in parsers.__all__)
