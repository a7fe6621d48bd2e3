"""Every public name of the package (a module's ``__all__``) documents itself."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import fla


def _public_objects():
    for info in pkgutil.walk_packages(fla.__path__, "fla."):
        if info.name.startswith("fla.cli"):
            continue   # the command line's modules document their commands (`-h`)
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{info.name}.{name}", obj


def test_every_public_function_and_class_has_a_docstring():
    undocumented = sorted(name for name, obj in _public_objects()
                          if not (obj.__doc__ or "").strip())
    assert not undocumented, "no docstring: " + ", ".join(undocumented)
