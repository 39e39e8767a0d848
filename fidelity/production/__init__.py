"""The production decoder under test: official numerics, precision profiles, preallocated caches."""

from fidelity.production.model import ContextError, ProductionModel, ProductionSession
from fidelity.production.profiles import BUILTIN as PROFILES
from fidelity.production.profiles import Profile, get_profile

__all__ = ["PROFILES", "ContextError", "ProductionModel", "ProductionSession", "Profile", "get_profile"]
