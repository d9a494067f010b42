"""FX graph helpers shared by the DeepCompile patches."""

from __future__ import annotations

from typing import Any

__all__ = ["is_call"]


def is_call(node: Any, target: Any) -> bool:
    """Whether the FX ``node`` calls ``target`` (an op overload or a function)."""
    return node.op == "call_function" and node.target == target
