"""Request body bytes -> a JSON value, refusing what a strict JSON reader would not serve.

Refused with a 400 that names where: invalid UTF-8, malformed JSON, the non-standard constants
`NaN` / `Infinity` and numbers that overflow to infinity, nesting deeper than the limit (the C
parser would otherwise hit the interpreter's recursion limit), and lone UTF-16 surrogates
(`"\\ud800"`), which are valid JSON escapes but no text any tokenizer can encode.
"""

from __future__ import annotations

import json
import math
from typing import Any

from loraplex.server.protocol import APIError


def parse_json_body(body: bytes, max_depth: int) -> Any:
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {err.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except APIError:
        raise
    except RecursionError:
        raise APIError(400, f"malformed JSON body: nested deeper than {max_depth} levels") from None
    except ValueError as err:  # JSONDecodeError, and ints over the interpreter's digit limit
        raise APIError(400, f"malformed JSON body: {err}") from None
    _check_tree(value, max_depth)
    return value


def _refuse_constant(name: str) -> float:
    raise APIError(400, f"malformed JSON body: {name} is not a JSON number; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(400, f"malformed JSON body: {text[:40]} overflows; numbers must be finite")
    return value


def _check_tree(root: Any, max_depth: int) -> None:
    """Depth and text checks in one iterative walk (no recursion on hostile input)."""
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if depth > max_depth:
            raise APIError(400, f"JSON nested deeper than {max_depth} levels", param=path or None)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1, f"{path}[{i}]"))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = f" in {path}" if path else ""
        raise APIError(
            400,
            f"invalid text{where}: a lone UTF-16 surrogate (U+{ord(text[err.start]):04X}) at character "
            f"{err.start} is not a Unicode character",
            param=path.split("[")[0].split(".")[0] or None,
        ) from None
