"""The code's structure, read from the source (issue 31's before/after figures): files and lines of
`specwood/`, the largest files, import circles and imports from a higher layer (the import graph of
tests/test_layering.py, function-local imports included), and function-local imports of specwood's
own modules.

    python benchmarks/structure.py [CHECKOUT ...]     # default: this checkout
    git worktree add /tmp/before REV && python benchmarks/structure.py /tmp/before .
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
import test_layering as layering  # noqa: E402 - the graph the layering test checks


def local_internal_imports(tree: ast.AST) -> int:
    """Imports of specwood modules inside functions."""
    n = 0
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    n += bool(node.level) or (node.module or "").startswith("specwood")
                elif isinstance(node, ast.Import):
                    n += any(a.name.startswith("specwood") for a in node.names)
    return n


def structure(checkout: Path) -> dict:
    package = checkout / "specwood"
    files = sorted(package.rglob("*.py"))
    lines = {str(p.relative_to(checkout)): len(p.read_text().splitlines()) for p in files}
    graph = layering.import_graph(package)
    per_package: dict[str, int] = {}
    for name, n in lines.items():
        parts = name.split("/")
        key = "/".join(parts[:2]) if len(parts) > 2 else "specwood/*.py"
        per_package[key] = per_package.get(key, 0) + n
    return {"files": len(files), "lines": sum(lines.values()),
            "largest": sorted(lines.items(), key=lambda kv: -kv[1])[:3],
            "over_600": sorted((k, v) for k, v in lines.items() if v > 600),
            "circles": layering.circles(graph), "upward": layering.upward_imports(graph),
            "local_imports": sum(local_internal_imports(ast.parse(p.read_text())) for p in files),
            "per_package": dict(sorted(per_package.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkouts", nargs="*", default=[str(HERE)])
    for checkout in ap.parse_args().checkouts:
        s = structure(Path(checkout).resolve())
        print(f"## {checkout}")
        print(f"files {s['files']}, lines {s['lines']}; largest: "
              + ", ".join(f"{k} {v}" for k, v in s["largest"]))
        print(f"files over 600 lines: {len(s['over_600'])} ({', '.join(f'{k} {v}' for k, v in s['over_600'])})")
        print(f"import circles: {len(s['circles'])} ({sum(len(c) for c in s['circles'])} modules in them); "
              f"imports from a higher layer: {len(s['upward'])}; function-local imports of specwood modules: "
              f"{s['local_imports']}")
        print("lines per package: " + ", ".join(f"{k} {v}" for k, v in s["per_package"].items()))


if __name__ == "__main__":
    main()
