"""Functions stay under 60 lines in the library, the kernels and the scripts, read from the source
with `ast`: a function's length runs from its `def` line to its last line (decorators excluded);
a nested function counts on its own and inside its parent."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREES = ("rekv_jax", "pallas_kernels", "scripts")
MAX_LINES = 60


def long_functions(root: pathlib.Path, limit: int = MAX_LINES) -> list[str]:
    """`file:line name (N lines)` for every function of `TREES` under `root` longer than
    `limit` lines."""
    out = []
    for tree in TREES:
        for file in sorted((root / tree).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(), str(file))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        out.append(f"{file.relative_to(root)}:{node.lineno} {node.name} "
                                   f"({length} lines)")
    return out


def test_no_function_is_over_60_lines():
    assert (ROOT / "scripts" / "soak.py").exists()  # the trees this test walks are the project's
    assert not long_functions(ROOT), "\n".join(long_functions(ROOT))


def test_the_check_finds_planted_long_functions(tmp_path):
    def body(n: int) -> str:
        return "".join(f"    x{i} = {i}\n" for i in range(n))

    files = {
        # 1 def line + 59 body lines: at the limit, its decorator not counted
        "rekv_jax/ok.py": "import functools\n\n\n@functools.cache\ndef at_limit():\n"
                          + body(59),
        # a method of 61 lines, async
        "rekv_jax/model/long.py": "class C:\n    async def method(self):\n"
                                  + body(60).replace("    ", "        "),
        # a short inner function inside a long outer one: only the outer is named
        "pallas_kernels/k.py": "def outer():\n    def inner():\n        pass\n" + body(59),
        "scripts/s.py": "\n\ndef main():\n" + body(61),
        "tests/test_x.py": "def test_long():\n" + body(100),  # tests are not walked
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert long_functions(tmp_path) == [
        "rekv_jax/model/long.py:2 method (61 lines)",
        "pallas_kernels/k.py:1 outer (62 lines)",
        "scripts/s.py:3 main (62 lines)",
    ]
