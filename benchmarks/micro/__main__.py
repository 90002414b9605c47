"""`python -m benchmarks.micro NAME [its flags]`: runs benchmarks/micro/NAME.py as `python -m benchmarks.micro.NAME`
would, with the flags that follow; without a name, lists the names and what each measures."""

from __future__ import annotations

import ast
import pkgutil
import runpy
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """Each benchmark's name and the first paragraph of its docstring, on one line (read, not imported)."""
    found = {}
    for module in pkgutil.iter_modules([str(HERE)]):
        if module.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse((HERE / f"{module.name}.py").read_text())) or ""
        found[module.name] = " ".join(doc.split("\n\n")[0].split())
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    found = benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m benchmarks.micro NAME [its flags]    (NAME --help: its flags)\n")
        width = max(map(len, found))
        for name, what in found.items():
            print(textwrap.fill(what, 116, initial_indent=f"  {name:{width}}  ", subsequent_indent=" " * (width + 4)))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"python -m benchmarks.micro: no benchmark {name!r}; one of: {', '.join(found)}", file=sys.stderr)
        return 2
    sys.argv = [name, *rest]  # runpy puts the module's path first, as `python -m` does
    runpy.run_module(f"benchmarks.micro.{name}", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
