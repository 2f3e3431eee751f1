"""The package's layering: import-linter's contracts (pyproject.toml) hold, and the package's own modules are
imported at the top of files, except where a comment says why one is imported late."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN = ("posttrain", "rewards")


def late_own_imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, module, whether a comment says why) for each import of posttrain / rewards inside a function
    or class body: the comment is on the import's line or just above its block of imports."""
    found = []
    for path in sorted([*REPO.glob("posttrain/**/*.py"), *REPO.glob("rewards/**/*.py")]):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.col_offset == 0:
                continue
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if getattr(node, "level", 0) or not any(m.split(".")[0] in OWN for m in modules):
                continue
            i = node.lineno - 1
            said = "#" in lines[i]
            while not said and i > 0 and (not lines[i - 1].strip()
                                          or lines[i - 1].strip().startswith(("from ", "import "))):
                i -= 1
            said = said or (i > 0 and lines[i - 1].strip().startswith("#"))
            found.append((str(path.relative_to(REPO)), node.lineno, modules[0], said))
    return found


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_late_imports_of_the_package_say_why():
    late = late_own_imports()
    unexplained = [f"{f}:{line} imports {m}" for f, line, m, said in late if not said]
    print(f"{len(late)} imports of posttrain / rewards inside functions, {len(unexplained)} without a comment")
    assert not unexplained, ("import these at the top of the file, or say in a comment above the import why it "
                             "is late (a heavy optional dependency):\n  " + "\n  ".join(unexplained))


def test_the_late_import_check_sees_an_unexplained_import(tmp_path, monkeypatch):
    (tmp_path / "posttrain").mkdir()
    (tmp_path / "posttrain" / "m.py").write_text(
        "def f():\n    from posttrain import config\n\n\ndef g():\n    # torch: only when training\n"
        "    from posttrain import training\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    assert [(line, said) for _, line, _, said in late_own_imports()] == [(2, False), (7, True)]
