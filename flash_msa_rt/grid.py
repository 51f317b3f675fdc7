"""Grid rules: the manifest states each grid dimension as an expression over the launch's named sizes.

The grammar is tiny on purpose: integers, names, + - * //, ceil_div(a, b), min(a, b), max(a, b). Rules are
parsed once per variant and evaluated per new tensor signature.
"""

from __future__ import annotations

import ast
from typing import Callable

_FUNCS: dict[str, Callable[..., int]] = {
    "ceil_div": lambda a, b: -(-a // b),
    "min": min,
    "max": max,
}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.FloorDiv: lambda a, b: a // b}


class GridRuleError(ValueError):
    pass


def compile_rule(text: str) -> Callable[[dict[str, int]], int]:
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise GridRuleError(f"grid rule {text!r} does not parse: {e}") from e

    def ev(node, env):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise GridRuleError(f"grid rule {text!r} names {node.id!r}, not among {sorted(env)}")
            return env[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left, env), ev(node.right, env))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
            return _FUNCS[node.func.id](*(ev(a, env) for a in node.args))
        raise GridRuleError(f"grid rule {text!r}: unsupported construct {ast.dump(node)[:60]}")

    _check_names(tree, text)
    return lambda env: int(ev(tree, env))


def _check_names(tree, text):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS):
            raise GridRuleError(f"grid rule {text!r}: only {sorted(_FUNCS)} may be called")
