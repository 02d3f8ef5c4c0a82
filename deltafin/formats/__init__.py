"""Weight formats, one module each: the spine's (bf16.py as stored, int8.py row-int8, q4.py 4-bit groups) and the
routed experts' (mxfp4.py as stored; q3.py, 3-bit groups, a converted copy that an expert mode reads). Each says its
name, the bytes a matrix takes in it, whether it is converted once to the disk, where it keeps the matrices it
cannot hold or must keep at 8 bits, what it costs in quality as measured, and
(named as module:function, loaded at first use) how a matrix is quantized, written, read back, dequantized and
multiplied on each device; it registers itself (registry.py) when this package loads it. The planner, the
converter, the kernels and the command line's choices read the registry, so that adding a format is adding its
module here (and its tests). Torch-free at import: `--help` lists the formats without loading torch.

May import: basics.
"""

from __future__ import annotations

import importlib
import pkgutil

from deltafin.formats.registry import (
    EXPERTS,
    SPINE,
    Entry,
    WeightFormat,
    auto_spines,
    converted_spines,
    expert_format,
    held_format,
    low_bit_format,
    low_bit_formats,
    register,
    registered,
    spine_choices,
    spine_format,
    spine_formats,
    stored_spine,
    unregister,
    weight_format,
)

__all__ = ["EXPERTS", "SPINE", "Entry", "WeightFormat", "auto_spines", "converted_spines", "expert_format",
           "held_format", "low_bit_format", "low_bit_formats", "register", "registered", "spine_choices",
           "spine_format", "spine_formats", "stored_spine", "unregister", "weight_format"]

# every module of this package but the registry is a format, registered as it loads (a new one needs no line here)
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")
