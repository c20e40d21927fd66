"""Reading a transformers config whose attributes may differ from layer to layer.

A transformers config may be heterogeneous (``per_layer_config``, transformers 5.x): Gemma 4's
full-attention layers have a wider ``head_dim`` than its sliding ones, and reading such an
attribute on the config itself raises (``AmbiguousGlobalPerLayerAttributeError``).
:func:`layer_values` reads one value per layer where the attribute is per-layer and the config's
own value otherwise; every read of vkv that sizes something from a config (head dims, head counts)
goes through it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["each_layer", "layer_values", "positive_ints"]


def layer_values(config: Any, name: str) -> list[Any]:
    """``name``'s value in each layer of ``config`` where it is a per-layer attribute (one per
    layer, ``None`` for a layer without it), else ``[config.name]`` (``[None]`` when absent)."""
    per_layer = getattr(config, "per_layer_attributes", None)  # None unless the config is heterogeneous
    if per_layer and name in per_layer:
        return [getattr(layer, name, None) for layer in config.per_layer_config]
    return [getattr(config, name, None)]


def each_layer(config: Any, name: str, layers: int) -> list[Any]:
    """``name``'s value for each of the ``layers`` layers: :func:`layer_values`, the config's own
    value repeated where the attribute is not per-layer."""
    values = layer_values(config, name)
    return values if len(values) == layers else values[:1] * layers


def positive_ints(config: Any, *names: str) -> list[int]:
    """Every positive integer value the attributes ``names`` take over ``config``'s layers."""
    return [v for name in names for v in layer_values(config, name)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0]
