"""The fault switchboard (``fidelity mutants``): which named faults are injected right now. Every decoder that
plants faults asks ``on(name)`` at the place a fault lives; a decoder's catalogue (``register``) names the faults it
knows, e.g. ``fidelity.decoders.production.faults.FAULTS``. With nothing injected every check is False."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_known: dict[str, str] = {}  # fault name -> what it breaks, from every registered catalogue
_active: frozenset[str] = frozenset()


def register(catalogue: Mapping[str, str]) -> None:
    """Add the faults of a decoder's catalogue (name -> what it breaks) to the names ``inject`` accepts."""
    _known.update(catalogue)


def on(name: str) -> bool:
    """Is fault ``name`` injected right now?"""
    return name in _active


def active() -> frozenset[str]:
    """The faults injected right now."""
    return _active


@contextmanager
def inject(*names: str) -> Iterator[None]:
    """Inject the named faults for the duration of the block."""
    global _active
    unknown = sorted(set(names) - set(_known))
    if unknown:
        raise KeyError(f"fault(s) {unknown}: expected names from {sorted(_known)}")
    previous, _active = _active, frozenset(names)
    try:
        yield
    finally:
        _active = previous
