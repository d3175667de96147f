"""Token mixers: memory layers over the unified recurrence and attention layers.

Every mixer registers itself by name; :func:`build_mixer` builds one from :class:`MixerArgs`.
"""

import importlib
import pkgutil

from .base import LayerState, Mixer, MixerArgs, build_mixer, mixer_class, mixer_names, register_mixer
from .recurrent import MemoryMixer, RecurrenceArgs

# every module of this package registers its mixers when imported
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "LayerState",
    "Mixer",
    "MixerArgs",
    "MemoryMixer",
    "RecurrenceArgs",
    "build_mixer",
    "mixer_class",
    "mixer_names",
    "register_mixer",
]
