"""Dependencies run one way: models <- decode <- data <- everything above (train, serve, api, bench,
diagnose, cli). A lower package that imports a higher one, even inside a function, fails here."""

import ast
from pathlib import Path

import anchorspec

PACKAGE = Path(anchorspec.__file__).parent
BASE = {"errors", "atomic", "metrics", "allocator", "progress"}  # leaf modules anyone may import
LAYERS = ["models", "decode", "data"]  # each may import the ones before it, and BASE


def imported_packages(path: Path, root: Path = PACKAGE) -> set[str]:
    """The top-level anchorspec packages or modules `path` (a file under `root`, the anchorspec
    package) imports, absolutely or relatively."""
    parts = path.relative_to(root).parts[:-1]  # the file's package, inside anchorspec
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("anchorspec.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = (node.module or "").split(".")
                if names[0] == "anchorspec":
                    found |= {names[1]} if len(names) > 1 else {a.name for a in node.names}
                continue
            base = list(parts[: len(parts) - (node.level - 1)])
            names = base + (node.module.split(".") if node.module else [])
            found |= {names[0]} if names else {a.name for a in node.names}
    return found


def test_imported_packages_reads_relative_and_lazy_imports(tmp_path):
    (tmp_path / "models").mkdir()
    probe = tmp_path / "models" / "probe.py"
    probe.write_text("import torch\nfrom . import hub\nfrom ..errors import AnchorspecError\n"
                     "def f():\n    from ..decode.engine import generate_vanilla\n    import anchorspec.train.trainer\n")
    assert imported_packages(probe, tmp_path) == {"models", "errors", "decode", "train"}


def test_lower_layers_import_nothing_above_them():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        allowed = BASE | set(LAYERS[: rank + 1])
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            wrong += [f"{path.relative_to(PACKAGE)} imports {p}" for p in imported_packages(path) - allowed]
    for name in BASE:
        path = PACKAGE / f"{name}.py"
        wrong += [f"{name}.py imports {p}" for p in imported_packages(path) - BASE]
    assert not wrong, "\n".join(wrong)
