"""vLLM's compilation_config (LLM's argument) read as what minillm can honour: CUDA graphs on or off.

minillm compiles no torch graphs; it captures full CUDA graphs of decode steps and piecewise ones
of the others (vLLM's cudagraph_mode FULL_AND_PIECEWISE), at batch sizes it chooses, or none
(enforce_eager=True). vLLM's mode 0 (NONE) turns piecewise graphs off, and with them a
FULL_AND_PIECEWISE or PIECEWISE cudagraph_mode (VllmConfig overrides it to NONE): minillm runs eager
there. A key or value with no such meaning is a ValueError naming it.
"""
from __future__ import annotations

import numbers

from minillm.sampling_params import short_repr

COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")   # vLLM's 0..3
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_NEEDS_PIECEWISE_COMPILATION = ("PIECEWISE", "FULL_AND_PIECEWISE")
_SIZE_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")
KNOWN_KEYS = ("level", "mode", "cudagraph_mode") + _SIZE_KEYS
_GRAPHS = ("minillm captures full CUDA graphs of decode steps and piecewise ones of the others "
           "(FULL_AND_PIECEWISE), or none (NONE, or enforce_eager=True)")
_SIZES = "minillm chooses the batch sizes it captures CUDA graphs for (enforce_eager=True turns them off)"


def _bad(key: str, value, does: str) -> ValueError:
    return ValueError(f"compilation_config[{key!r}]={short_repr(value)} is not supported: {does}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _mode_name(key: str, value) -> str:
    """vLLM's compilation mode (an int 0-3, its name in any case, or the enum) as its name."""
    if _is_int(value) and 0 <= value < len(COMPILATION_MODES):
        return COMPILATION_MODES[int(value)]
    if isinstance(value, str) and value.upper() in COMPILATION_MODES:
        return value.upper()
    raise ValueError(f"compilation_config[{key!r}] must be 0-3 or one of {', '.join(COMPILATION_MODES)}, "
                     f"got {short_repr(value)}")


def _cudagraph_mode_name(value) -> str:
    """vLLM's cudagraph_mode (its name in any case, or the enum) as its name."""
    name = getattr(value, "name", value)
    if isinstance(name, str) and name.upper() in CUDAGRAPH_MODES:
        return name.upper()
    raise ValueError(f"compilation_config['cudagraph_mode'] must be one of {', '.join(CUDAGRAPH_MODES)}, "
                     f"got {short_repr(value)}")


def _captures_no_size(config: dict) -> bool:
    """The capture sizes given leave no batch size to capture: [] or a largest size of 0."""
    sizes, largest = config.get("cudagraph_capture_sizes"), config.get("max_cudagraph_capture_size")
    if sizes is not None and (not isinstance(sizes, (list, tuple)) or not all(_is_int(s) and s > 0 for s in sizes)):
        raise ValueError(f"compilation_config['cudagraph_capture_sizes'] must be a list of positive batch sizes, "
                         f"got {short_repr(sizes)}")
    if largest is not None and (not _is_int(largest) or largest < 0):
        raise ValueError(f"compilation_config['max_cudagraph_capture_size'] must be a non-negative integer, "
                         f"got {short_repr(largest)}")
    return (sizes is not None and len(sizes) == 0) or largest == 0


def _as_dict(value) -> dict:
    """compilation_config as a dict of vLLM's keys: an int is its mode, as vLLM's LLM reads it."""
    if value is None:
        return {}
    if _is_int(value):
        if value != 0:
            raise ValueError(f"compilation_config={short_repr(value)} is not supported: minillm compiles no torch "
                             f"graphs (0 runs without compiling)")
        return {"mode": value}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"compilation_config must be a compilation mode (0) or a dict of vLLM's "
                         f"CompilationConfig fields, got {short_repr(value)}")
    for key in value:
        if key not in KNOWN_KEYS:
            raise _bad(key, value[key], f"minillm compiles no torch graphs; of vLLM's CompilationConfig it "
                                        f"takes {', '.join(KNOWN_KEYS)}")
    return value


def compilation_graphs_off(value) -> bool:
    """Whether compilation_config turns minillm's CUDA graphs off (enforce_eager); ValueError naming
    a key or value it cannot honour."""
    config = _as_dict(value)
    key = "mode" if config.get("mode") is not None else "level"
    mode = _mode_name(key, config[key]) if config.get(key) is not None else None
    if mode not in (None, "NONE"):
        raise _bad(key, config[key], "minillm compiles no torch graphs (mode 0 runs without compiling)")
    graphs = _cudagraph_mode_name(config["cudagraph_mode"]) if config.get("cudagraph_mode") is not None \
        else "FULL_AND_PIECEWISE"
    if mode == "NONE" and graphs in _NEEDS_PIECEWISE_COMPILATION:
        graphs = "NONE"                 # as in vLLM: piecewise graphs need mode 3 (VLLM_COMPILE)
    if graphs not in ("NONE", "FULL_AND_PIECEWISE"):
        raise _bad("cudagraph_mode", config["cudagraph_mode"], _GRAPHS)
    if _captures_no_size(config) or graphs == "NONE":
        return True
    for name in _SIZE_KEYS:
        if config.get(name) is not None:
            raise _bad(name, config[name], _SIZES)
    return False
