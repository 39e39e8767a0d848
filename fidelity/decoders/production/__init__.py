"""The production decoder under test: official numerics, precision profiles, preallocated caches."""

from fidelity.decoders.production.model import ProductionModel, ProductionSession
from fidelity.decoders.production.profiles import BUILTIN as PROFILES
from fidelity.decoders.production.profiles import Profile, get_profile

__all__ = ["PROFILES", "ProductionModel", "ProductionSession", "Profile", "get_profile"]
