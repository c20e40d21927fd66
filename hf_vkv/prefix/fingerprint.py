"""Fingerprints that tell whether cached K/V can belong to a model: its config and its weights.

K/V depend on the architecture *and* on the weights. The config fingerprint hashes the fields of
the (text) config that shape attention and the residual stream; the weights fingerprint hashes a
fixed sample of every parameter (its name, shape and a few hundred of its values), which
tells two checkpoints of one architecture apart without reading all the weights (~1 ms for
SmolLM2). Both are checks against mistakes, not proofs: two configs differing only in a field
missing from :data:`CONFIG_FIELDS` hash alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

__all__ = ["CONFIG_FIELDS", "config_fields", "config_fingerprint", "describe_difference", "weights_fingerprint"]

#: Config fields whose values change what a layer computes (those a config has are hashed).
CONFIG_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation",
    "max_position_embeddings", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "attention_bias", "mlp_bias", "query_pre_attn_scalar",
    "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings", "n_embd", "n_layer",
    "n_head", "n_positions", "n_inner", "activation_function", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "position_embedding_type",
    "per_layer_config",  # a heterogeneous config's per-layer values (Gemma 4's head dims); absent otherwise
)
_SAMPLE = 256  # values hashed per parameter (evenly spaced over the flattened tensor)


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_fields(config: Any) -> dict[str, Any]:
    """The :data:`CONFIG_FIELDS` the (text) config has, as JSON-ready values."""
    data = _text_config(config).to_dict()
    return {k: json.loads(json.dumps(data[k], sort_keys=True, default=str)) for k in CONFIG_FIELDS if k in data}


def config_fingerprint(config: Any) -> str:
    """sha256 (hex) of :func:`config_fields`."""
    blob = json.dumps(config_fields(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def describe_difference(a: dict[str, Any], b: dict[str, Any], *, a_name: str, b_name: str, most: int = 6) -> str:
    """``"field: <a_name> x, <b_name> y, ..."`` for the fields (at most ``most``) where two
    :func:`config_fields` dicts differ."""
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    parts = [f"{k}: {a_name} {a.get(k, '(absent)')!r}, {b_name} {b.get(k, '(absent)')!r}" for k in diff[:most]]
    if len(diff) > most:
        parts.append(f"and {len(diff) - most} more")
    return "; ".join(parts) or "fields outside the fingerprint's list"


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 (hex) over every parameter's name, shape and ``_SAMPLE`` evenly spaced values (as
    float32). A model cast to another dtype fingerprints differently: check the dtype first."""
    h = hashlib.sha256()
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = param.detach().reshape(-1)
        n, count = flat.numel(), min(_SAMPLE, flat.numel())
        # evenly spaced, in integers (a float32 linspace rounds past the end of a 28M-element tensor)
        index = (torch.arange(count, dtype=torch.int64) * (n - 1) // max(count - 1, 1)).to(flat.device)
        sample = flat[index].float().cpu().contiguous()
        h.update(f"{name}:{tuple(param.shape)};".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()
