"""Example user tools for examples/tools/tool_config.yaml: plain functions, keyword arguments from the model's
call, a str (or anything JSON can encode) back. They run inside dgrpo's tool sandbox, one process per call."""

_METERS = {"km": 1000.0, "m": 1.0, "cm": 0.01, "mi": 1609.344, "ft": 0.3048}


def unit_convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length; an unknown unit raises, and the error text becomes the tool message."""
    for u in (from_unit, to_unit):
        if u not in _METERS:
            raise ValueError(f"unknown unit {u!r} (known: {', '.join(_METERS)})")
    return f"{value * _METERS[from_unit] / _METERS[to_unit]:.6g} {to_unit}"
