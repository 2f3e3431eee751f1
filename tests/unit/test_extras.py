"""The CLI's table of which extra installs which optional module agrees with pyproject.toml's optional-dependencies,
so its "pip install 'posttrain[<extra>]'" line names the extra that really brings the missing module."""

from __future__ import annotations

import tomllib

from posttrain.cli import EXTRAS, main
from tests.extras import NOT_RUNTIME, REPO, extra_modules


def test_each_module_the_cli_names_comes_with_the_extra_it_names():
    installed = extra_modules()
    assert {module: installed.get(module) for module in EXTRAS} == EXTRAS


def test_every_runtime_extra_has_a_module_the_cli_knows():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras - NOT_RUNTIME == set(EXTRAS.values())


def test_all_installs_every_runtime_extra_but_the_gpu_and_harness_ones():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = extras["all"][0].split("[")[1].rstrip("]").split(",")
    assert set(named) == set(extras) - NOT_RUNTIME - {"gpu", "lmeval"}


def test_a_missing_optional_module_is_one_line_naming_the_extra(monkeypatch, capsys):
    def missing(argv):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    monkeypatch.setattr("posttrain.cli.run_command", missing)
    assert main(["stage=quantize"]) == 2
    assert "pip install 'posttrain[gguf]'" in capsys.readouterr().err


def test_a_missing_module_of_no_extra_is_not_hidden(monkeypatch):
    def missing(argv):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr("posttrain.cli.run_command", missing)
    try:
        main(["stage=sft"])
    except ModuleNotFoundError as err:
        assert err.name == "torch"
    else:
        raise AssertionError("a missing core module must surface as itself")
