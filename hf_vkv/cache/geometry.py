"""What every layer of a group shares, and the error for a layer that does not fit its group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.errors import VKVError

__all__ = ["GroupGeometry", "LayerMismatchError"]


class LayerMismatchError(VKVError, ValueError):
    """A layer's key/value states do not match the other layers of its group, or each other."""


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """Shape and type of one layer's tokens: ``kv_heads`` heads of ``key_dim`` key and
    ``value_dim`` value elements (they differ in multi-head latent attention, MLA)."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> GroupGeometry:
        """The geometry of ``[B, H, q, Dk]`` keys and ``[B, H, q, Dv]`` values of ``layer``."""
        k, v = key_states, value_states
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise LayerMismatchError(
                f"layer {layer}: key/value states must be [batch, kv_heads, tokens, head_dim] with the same batch, "
                f"heads and tokens, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype or k.device != v.device:
            autocast = k.dtype != v.dtype and torch.is_autocast_enabled(k.device.type)
            raise LayerMismatchError(
                f"layer {layer}: keys ({k.dtype} on {k.device}) and values ({v.dtype} on {v.device}) differ"
                + (": under torch.autocast a layer's keys and values can come out in different dtypes, and vkv "
                   f"keeps one dtype a layer; convert the model instead (model.to({v.dtype})) and generate outside "
                   "autocast, or use transformers' default cache"
                   if autocast else ": vkv keeps a layer's keys and values in one dtype on one device")
            )
        return cls(k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)

    def check(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise :class:`LayerMismatchError` unless ``[B, H, q, D]`` states of ``layer`` have this
        geometry (a wrong-shaped update, or a cache reused with another model). Cheap: on every
        update's path."""
        k, v = key_states, value_states
        if (k.dim() != 4 or v.dim() != 4 or k.shape[1] != self.kv_heads or k.shape[3] != self.key_dim
                or v.shape[3] != self.value_dim or k.shape[:3] != v.shape[:3] or k.dtype != self.dtype
                or v.dtype != self.dtype or k.device != self.device or v.device != self.device):
            raise LayerMismatchError(
                f"layer {layer}: got keys {tuple(k.shape)} / values {tuple(v.shape)} ({k.dtype}, {v.dtype} on "
                f"{k.device}) but this cache holds {self.describe()} as [batch, kv_heads, tokens, head_dim]; a cache "
                f"serves the model it was made for: create a new one for another model"
            )

    @property
    def token_elements(self) -> int:
        """Elements of one token of one layer, keys and values."""
        return self.kv_heads * (self.key_dim + self.value_dim)

    def describe(self) -> str:
        dims = f"dim {self.key_dim}" if self.key_dim == self.value_dim else \
            f"key dim {self.key_dim} / value dim {self.value_dim}"
        return f"{self.kv_heads} KV heads of {dims} in {self.dtype} on {self.device}"
