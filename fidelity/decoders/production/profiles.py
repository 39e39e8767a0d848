"""The production decoder's precision profiles: ``fidelity.decoders.profiles``, which the harness's thresholds read
too (one module object, imported here under the production decoder's name)."""

from fidelity.decoders.profiles import BUILTIN, CHOICES, Profile, get_profile, load_profile, profile_dict

__all__ = ["BUILTIN", "CHOICES", "Profile", "get_profile", "load_profile", "profile_dict"]
