"""Package names that load on first use (PEP 562), so that importing a package stays light.

    __getattr__, __dir__ = lazy_exports(__name__, {"LLM": "deepserve.llm", ...})

A leaf: imports nothing of deepserve, so any package's __init__ may use it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(__getattr__, __dir__) for `package`: each name in `exports` is imported from its module when first read,
    then kept in the package's namespace (later reads skip the lookup)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return __getattr__, __dir__
