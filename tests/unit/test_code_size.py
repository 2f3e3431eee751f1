"""Files stay small enough to read in one sitting and functions short enough to hold in one's head: no Python file
of the project over 400 lines, no function over 80 (counted with `ast`, docstring and comments included), and each
stage's `main` at most 60, one per stage module, so a stage reads top to bottom in one screen."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_STAGE_MAIN_LINES = 400, 80, 60


def project_files() -> list[Path]:
    return sorted(path for folder in ("posttrain", "rewards", "scripts", "tests") for path in (REPO / folder).rglob("*.py"))


def test_no_file_is_over_400_lines():
    files = project_files()
    assert len(files) > 100  # the walk found the project
    long = {str(p.relative_to(REPO)): n for p in files if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines (split what each holds two of): {long}"


def test_no_function_is_over_80_lines():
    long = {}
    for path in project_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_each_stage_has_one_main_of_at_most_60_lines():
    mains = {}
    for path in sorted((REPO / "posttrain" / "stages").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("main"):
                mains[f"{path.stem}:{node.name}"] = node.end_lineno - node.lineno + 1
    stages = {"pretrain", "sft", "reward_model", "grpo", "dpo", "quantize"}
    assert {key.split(":")[0] for key in mains} == stages
    assert sorted(mains) == sorted(f"{stage}:main" for stage in stages), f"one `main` per stage module: {mains}"
    long = {key: n for key, n in mains.items() if n > MAX_STAGE_MAIN_LINES}
    assert not long, f"stage mains over {MAX_STAGE_MAIN_LINES} lines (move a step into a named helper): {long}"
