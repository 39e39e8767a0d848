"""The fault switchboard (``fidelity mutants``): which named faults are injected right now. Every decoder that
plants faults asks ``on(name)`` at the place a fault lives; a decoder's catalogue (``register``) names the faults it
knows, e.g. ``fidelity.decoders.production.faults.FAULTS``. With nothing injected every check is False.

What is injected is context-scoped state (a ``ContextVar``): ``inject`` holds for its block in the thread or task
that entered it, never for another thread's decoder."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar

_known: dict[str, str] = {}  # fault name -> what it breaks, from every registered catalogue
_ACTIVE: ContextVar[frozenset[str]] = ContextVar("injected_faults", default=frozenset())


def register(catalogue: Mapping[str, str]) -> None:
    """Add the faults of a decoder's catalogue (name -> what it breaks) to the names ``inject`` accepts."""
    _known.update(catalogue)


def catalogue() -> dict[str, str]:
    """Every registered fault: name -> what it breaks (the union of the decoders' catalogues)."""
    return dict(_known)


def on(name: str) -> bool:
    """Is fault ``name`` injected right now?"""
    return name in _ACTIVE.get()


def active() -> frozenset[str]:
    """The faults injected right now."""
    return _ACTIVE.get()


@contextmanager
def inject(*names: str) -> Iterator[None]:
    """Inject the named faults for the duration of the block (in this context; a block inside replaces them)."""
    unknown = sorted(set(names) - set(_known))
    if unknown:
        raise KeyError(f"fault(s) {unknown}: expected names from {sorted(_known)}")
    token = _ACTIVE.set(frozenset(names))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
