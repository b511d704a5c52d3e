"""The layering of docs/ARCHITECTURE.md, held: each package imports only `pdgate/` (the shared kernel) and
itself, and the kernel imports none of the packages.

Why a test: the connector runs inside vLLM's engine process, so anything it imports from the router
(FastAPI, the pool, the policies) is loaded into every engine; and a simulator that imports the router's
rules tests the router's copy instead of its own. The one exception is the router's embedded metaserver
(one process on one machine), allowed only in the modules that build it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "metaserver", "connector", "sim", "deploy", "cli")
# The router may run the metaserver in its own process (no --metaserver): only these modules build it,
# serve its routes on the fast lane, or check that its store is shared between workers.
EMBEDS = {"router/app.py", "router/routes.py", "router/workers.py"}


def _imports(path: Path) -> set[str]:
    """Every `pdgate.*` module a file imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("pdgate"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pdgate"))
    return found


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_kernel_and_itself(package: str) -> None:
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for module in _imports(path):
            other = _package_of(module)
            if other is None or other == package:
                continue
            if package == "router" and other == "metaserver" and rel in EMBEDS:
                continue
            wrong.append(f"{rel} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_kernel_imports_no_package() -> None:
    wrong = [
        f"{path.name} imports {module}"
        for path in sorted((ROOT / "pdgate").glob("*.py"))
        for module in _imports(path)
        if _package_of(module) is not None
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rule_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from pdgate.router.pool import Pool\n    import pdgate.sim.app\n")
    assert {"pdgate.router.pool", "pdgate.sim.app"} <= _imports(f)
