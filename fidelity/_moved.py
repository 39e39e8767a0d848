"""Import paths of modules that moved into the subpackages, kept working: ``import fidelity.production.registry``
gives the module ``fidelity.decoders.production.registry`` itself (one module object under both names)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "fidelity.production": "fidelity.decoders.production",
    "fidelity.trace": "fidelity.decoders.trace_file",
    **{f"fidelity.{m}": f"fidelity.model.{m}" for m in ("config", "formats", "layouts", "sampling", "sites",
                                                      "synthesize", "text")},
    "fidelity.default_model": "fidelity.model.default",
    **{f"fidelity.{m}": f"fidelity.harness.{m}" for m in ("compare_sites", "dtype_flow", "judgement", "memory",
                                                        "opmode", "oracle_run", "runner", "thresholds")},
    **{f"fidelity.{m}": f"fidelity.outputs.{m}" for m in ("compare", "plots", "report", "rundir")},
}


def new_name(name: str) -> str | None:
    """The module ``name`` is now, or None when it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        return importlib.import_module(new_name(spec.name))

    def exec_module(self, module) -> None:  # already executed under its new name
        pass


def install() -> None:
    if not any(isinstance(f, _Redirect) for f in sys.meta_path):
        sys.meta_path.insert(0, _Redirect())
