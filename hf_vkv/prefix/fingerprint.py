"""Fingerprints that tell whether cached K/V can belong to a model: its config and its weights.

K/V depend on the architecture *and* on the weights. The config fingerprint hashes the fields of
the (text) config that shape attention and the residual stream (:data:`CONFIG_FIELDS`) and every
other field but those that change nothing a layer computes in eval mode (:data:`INERT_FIELDS`:
ids, names, outputs asked for, dropout, initialisation; :func:`config_rest`), so that a model
built with another value of any field (``num_experts_per_tok=1`` from ``from_pretrained``, a
``residual_multiplier``) is another model; a file compares its recorded fields with the model's
(:func:`config_difference`), the other fields where both have them. The weights fingerprint
hashes a fixed sample of every parameter (its name, shape and a few hundred of its values), which
tells two checkpoints of one architecture apart without reading all the weights (a few ms
for SmolLM2 on a CPU, taken at each use), the same sample of every buffer (a rotary embedding's
``inv_freq`` rewritten in place changes every key), and what changes what a layer computes without changing a
parameter (:func:`computation_state`): the state of the model's adapter layers (which adapters
are active, disabled or merged, and their scaling), the forward hooks a user put on it, and an
attention implementation other than sdpa's. In a process, :func:`weights_identity` adds which
tensors the parameters and buffers are and their version counters, which torch bumps at every
in-place write through a tensor (an optimizer step, ``load_state_dict``, ``param[i] += x`` under
``torch.no_grad()``): a store that saw other tensors or counters steps aside, whatever the sampled
values. Weights packed outside the parameters (torch.ao quantization) cannot be fingerprinted
(:class:`~hf_vkv.PrefixMismatchError`). Both are checks against mistakes,
not proofs: a parameter written through ``param.data`` (or numpy) only between the sampled values
is not seen, nor is a change in what a hook does or in what a module computes from plain Python
attributes (an adapter's on/off flag, a parametrization's attribute).
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from .errors import PrefixMismatchError

__all__ = [
    "CONFIG_FIELDS", "INERT_FIELDS", "LIBRARY_HOOKS", "OFFLOADED", "SDPA_EXACT_ATTENTION", "WEIGHTS_DIFFER", "adapter_state",
    "computation_state", "config_difference", "config_fields", "config_fingerprint", "config_record", "config_rest",
    "describe_config_difference", "describe_difference", "earlier_fingerprints", "in_training", "is_adapter_layer",
    "per_row_adapters", "TensorsSeen", "unwrapped", "weights_fingerprint", "weights_identity", "weights_match",
]

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
_SAMPLE = 256  # values hashed per parameter: all of a smaller one, else _BLOCKS runs of consecutive values
_BLOCKS = 8  # runs of _SAMPLE // _BLOCKS values, evenly spaced from the first value to the last


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_fields(config: Any) -> dict[str, Any]:
    """The :data:`CONFIG_FIELDS` the (text) config has, as JSON-ready values."""
    return _fields_of(_text_config(config).to_dict())


def _fields_of(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _json_ready(data[k]) for k in CONFIG_FIELDS if k in data}


#: Values that come back from a JSON round trip as they went in (``float``: NaN stays NaN).
_PLAIN = frozenset({int, float, str, bool, type(None)})


def _json_ready(value: Any) -> Any:
    """``value`` as JSON gives it back (sorted keys, anything else as its ``str``); a plain value as it is."""
    if type(value) in _PLAIN:
        return value
    return json.loads(json.dumps(value, sort_keys=True, default=str))


#: Config fields that change nothing a layer computes in eval mode, left out of :func:`config_rest`
#: (with every private field, ``_``-first, and those ending in :data:`_INERT_ENDINGS`): names and
#: ids, outputs and options of a call, the dtype (checked apart), dropout and training-only terms,
#: initialisation, generation defaults, parallelism plans.
INERT_FIELDS = frozenset({
    "architectures", "transformers_version", "name_or_path", "model_name_or_path", "auto_map", "id2label", "label2id",
    "finetuning_task", "task_specific_params", "problem_type", "tokenizer_class", "prefix", "torchscript",
    "return_dict", "output_attentions", "output_hidden_states", "output_router_logits", "output_scores",
    "return_dict_in_generate", "use_cache", "dtype", "torch_dtype", "use_bfloat16", "tf_legacy_loss",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "initializer_range", "initializer_factor", "init_std", "router_aux_loss_coef",
    "router_z_loss_coef", "router_jitter_noise", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan",
    "tp_plan", "pp_plan", "keys_to_ignore_at_inference",
})
_INERT_ENDINGS = ("_token_id", "_token_ids", "dropout", "_pdrop", "layerdrop", "dropout_rate", "dropout_prob")


def config_rest(config: Any) -> dict[str, Any]:
    """The (text) config's other fields, as JSON-ready values: every one that is not in
    :data:`CONFIG_FIELDS`, not private and not inert (:data:`INERT_FIELDS`)."""
    return _rest_of(_text_config(config).to_dict())


def _rest_of(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _json_ready(v) for k, v in data.items() if k not in CONFIG_FIELDS and not k.startswith("_")
            and k not in INERT_FIELDS and not k.endswith(_INERT_ENDINGS)}


def _digest(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def _fingerprint_of(fields: dict[str, Any], rest: dict[str, Any]) -> str:
    return _digest({**fields, " rest": rest})


def config_record(config: Any) -> dict[str, Any]:
    """What a prefix file records of ``config``: ``config_fingerprint`` (sha256, hex, of
    :func:`config_fields` and :func:`config_rest`: configs that fingerprint alike compute alike),
    ``config_fields`` and ``config_rest``."""
    data = _text_config(config).to_dict()
    fields, rest = _fields_of(data), _rest_of(data)
    return {"config_fingerprint": _fingerprint_of(fields, rest), "config_fields": fields, "config_rest": rest}


def config_fingerprint(config: Any) -> str:
    """The ``config_fingerprint`` of :func:`config_record` (two objects of one config fingerprint alike)."""
    return config_record(config)["config_fingerprint"]


def config_difference(saved: dict[str, Any], record: dict[str, Any]) -> str | None:
    """What differs between a file's recorded config (``saved``: its ``config_fingerprint``,
    ``config_fields`` and, written since the other fields were fingerprinted, ``config_rest``) and
    a config's :func:`config_record` (``None``: the file can be that config's). The fields of
    :data:`CONFIG_FIELDS` must all agree; of the others, those both record (a field that one
    transformers release has and another lacks says nothing). A file that recorded no fields is
    compared by its fingerprint of :data:`CONFIG_FIELDS` alone."""
    fields, rest = record["config_fields"], record["config_rest"]
    saved_fields, saved_rest = saved.get("config_fields"), saved.get("config_rest")
    if not isinstance(saved_fields, dict) or not saved_fields:
        return None if saved.get("config_fingerprint") == _digest(fields) else "fields outside the fingerprint's list"
    if saved_fields != fields:
        return describe_difference(saved_fields, fields, a_name="file", b_name="model")
    if not isinstance(saved_rest, dict):  # written before the other fields were fingerprinted
        return None if saved.get("config_fingerprint") == _digest(fields) else "a fingerprint that is not its fields'"
    if saved.get("config_fingerprint") != _fingerprint_of(saved_fields, saved_rest):
        return "a fingerprint that is not its fields'"
    differ = sorted(k for k in saved_rest.keys() & rest.keys() if saved_rest[k] != rest[k])
    if not differ:
        return None
    return describe_difference({k: saved_rest[k] for k in differ}, {k: rest[k] for k in differ}, a_name="file",
                               b_name="model")


def describe_config_difference(a: Any, b: Any, *, a_name: str, b_name: str) -> str:
    """:func:`describe_difference` of two configs over :func:`config_fields` and :func:`config_rest`."""
    return describe_difference({**config_fields(a), **config_rest(a)}, {**config_fields(b), **config_rest(b)},
                               a_name=a_name, b_name=b_name)


def describe_difference(a: dict[str, Any], b: dict[str, Any], *, a_name: str, b_name: str, most: int = 6) -> str:
    """``"field: <a_name> x, <b_name> y, ..."`` for the fields (at most ``most``) where two
    :func:`config_fields` dicts differ."""
    diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    parts = [f"{k}: {a_name} {a.get(k, '(absent)')!r}, {b_name} {b.get(k, '(absent)')!r}" for k in diff[:most]]
    if len(diff) > most:
        parts.append(f"and {len(diff) - most} more")
    return "; ".join(parts) or "fields outside the fingerprint's list"


#: What a refusal of weights on the meta device says of them.
OFFLOADED = "a store's weights fingerprint reads the parameters, and these are not in memory"

#: dtypes whose CPU tensors are sampled through numpy
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8})
_CPU = torch.device("cpu")


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft ``PeftModel`` (its ``get_base_model()``, the model
    whose ``generate`` runs, with the adapter layers in it); any other model as it is. A store
    saved or opened with the wrapper fingerprints as the model that fills and reads it."""
    get_base = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base) else model


def is_adapter_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an adapter layer: one of peft's tuner layers (which transformers'
    ``load_adapter`` makes too), told by the properties their class defines, ``active_adapters``
    and ``disable_adapters``."""
    return _adapter_class(type(module))


def per_row_adapters(model: torch.nn.Module) -> bool:
    """Whether an adapter layer of ``model`` has forward pre-hooks: peft registers them for a
    ``generate(..., adapter_names=[...])`` call, which runs each row with an adapter of its own
    (nothing in :func:`adapter_state` says which)."""
    return any(is_adapter_layer(m) and m._forward_pre_hooks for m in unwrapped(model).modules())


def adapter_state(model: torch.nn.Module) -> list[list[Any]]:
    """What the model's adapter layers compute with besides their parameters, one item a layer
    in the order of ``model.modules()``: its active adapters, whether adapters are disabled, the
    merged ones, and the active ones' scaling where the layer has one (LoRA's). Switching,
    disabling, merging or rescaling an adapter changes it; empty for a model without adapter layers."""
    return _walk(model)[1]


#: Where the forward hooks come from that record or move tensors without changing what a layer
#: computes (transformers' output capturing; peft's per-row adapter hooks are refused apart): a
#: hook defined anywhere else is the user's.
LIBRARY_HOOKS = ("transformers.", "torch.", "accelerate.", "peft.", "hf_vkv.")


def _walk(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Parameter]], list[list[Any]], list[list[int]],
                                           list[tuple[str, torch.Tensor]], list[str]]:
    """One pass over ``model``'s modules in the order of ``model.modules()``: its parameters as
    ``model.named_parameters()`` names them (each once, under its first name), the adapter
    layers' states (:func:`adapter_state`), and the forward hooks and pre-hooks no library put
    on its modules (a steering vector, an activation patch: they may change what a layer
    computes, and nothing says how), each as ``[place in the order of model.modules(), handle
    id]`` (``-1``: a global module hook), its buffers as ``model.named_buffers()`` names them,
    and the modules whose weights are packed where neither is (torch.ao's quantized modules hold
    them in a ``_packed_params`` script object, unpacked at a cost of ~1.5 ms a layer: SmolLM2's
    422 quantized Linear layers take 0.65 s). A hook is known by its handle: the same hook
    registered again is another one. (An explicit stack: torch's nested generators took about a
    third of the fingerprint's time.)"""
    params: list[tuple[str, torch.nn.Parameter]] = []
    buffers: list[tuple[str, torch.Tensor]] = []
    adapters: list[list[Any]] = []
    packed: list[str] = []
    hooks = [[-1, key] for key in _user_hook_keys(_global_forward_hooks, _global_forward_pre_hooks)]
    seen_modules: set[int] = set()
    seen_params: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    pop, push = stack.pop, stack.append
    place = 0
    while stack:
        prefix, module = pop()
        if id(module) in seen_modules:
            continue
        seen_modules.add(id(module))
        own, held, forward, pre, children, packed_params = _module_tables(module)
        if own:
            for key, param in own.items():
                if param is not None and id(param) not in seen_params:
                    seen_params.add(id(param))
                    params.append((prefix + key, param))
        if held:
            for key, buffer in held.items():
                if buffer is not None and id(buffer) not in seen_params:
                    seen_params.add(id(buffer))
                    buffers.append((prefix + key, buffer))
        if forward or pre:
            hooks.extend([place, key] for key in _user_hook_keys(forward, pre))
        if _adapter_class(type(module)):
            adapters.append(_layer_state(module))
        if isinstance(packed_params, torch.ScriptObject):
            packed.append(prefix.removesuffix(".").removesuffix("._packed_params") or type(module).__name__)
        if children:
            for key, child in reversed(children.items()):
                if child is not None:
                    push((f"{prefix}{key}.", child))
        place += 1
    return params, adapters, hooks, buffers, packed


def _module_tables(module: torch.nn.Module) -> tuple[Any, ...]:
    """``module``'s parameters, buffers, forward hooks, forward pre-hooks and children (the dicts
    ``nn.Module`` keeps in its ``__dict__``: read there, they cost no attribute lookup, which was
    half of :func:`_walk`'s time), and its ``_packed_params`` (torch.ao's quantized modules;
    ``None`` if it has none). A module that keeps them elsewhere (a scripted one) is read through
    its attributes."""
    d = vars(module)
    try:
        return (d["_parameters"], d["_buffers"], d["_forward_hooks"], d["_forward_pre_hooks"], d["_modules"],
                d.get("_packed_params"))
    except KeyError:
        return (module._parameters, module._buffers, module._forward_hooks, module._forward_pre_hooks,
                module._modules, d.get("_packed_params"))


@functools.lru_cache(maxsize=None)
def _adapter_class(cls: type) -> bool:
    return isinstance(getattr(cls, "active_adapters", None), property) and \
        isinstance(getattr(cls, "disable_adapters", None), property)


def _layer_state(module: torch.nn.Module) -> list[Any]:
    active = module.active_adapters
    active = [active] if isinstance(active, str) else [str(a) for a in active]
    scaling = getattr(module, "scaling", None)
    scales = [float(scaling[a]) for a in active if a in scaling] if isinstance(scaling, dict) else []
    merged = [str(a) for a in getattr(module, "merged_adapters", [])]
    return [active, bool(module.disable_adapters), merged, scales]


def in_training(model: torch.nn.Module) -> str | None:
    """What of ``model`` is in training mode (``"the model"``, or the name of its first module
    that is), where dropout and the like make K/V differ from one forward to the next; ``None``
    where every module is in eval mode."""
    name = next((name for name, module in model.named_modules() if module.training), None)
    return None if name is None else name or "the model"


def user_hooks(model: torch.nn.Module) -> list[str]:
    """Where forward hooks or pre-hooks that no library put (:data:`LIBRARY_HOOKS`) sit on
    ``model``: the names of its modules that hold one (``"(global)"`` for a module hook registered
    for every module). Such a hook may change what a layer computes, draw random numbers, or act
    on the batch's rows: nothing says which."""
    out = ["(global)"] if _user_hook_keys(_global_forward_hooks, _global_forward_pre_hooks) else []
    return out + [name or type(model).__name__ for name, module in model.named_modules()
                  if (module._forward_hooks or module._forward_pre_hooks)
                  and _user_hook_keys(module._forward_hooks, module._forward_pre_hooks)]


def _user_hook_keys(*tables: dict[int, Any]) -> list[int]:
    """The handle ids of the hooks in ``tables`` that no library put. Each table is copied first, in
    one C call: another thread's ``generate`` (prefill once) adds and removes hooks meanwhile, and an
    ``OrderedDict`` changed while Python code iterates it raises ``RuntimeError``."""
    return [key for table in tables for key, hook in tuple(table.items()) if not _from_library(hook)]


def _from_library(hook: Any) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "__func__", function)  # a bound method
    return str(getattr(function, "__module__", "")).startswith(LIBRARY_HOOKS)


#: What a refusal of other weights says they cover (the store's, a file's and generate's refusals).
WEIGHTS_DIFFER = ("weights fingerprints differ: they cover the parameters and buffers, which adapters are active, "
                  "disabled or merged, the attention implementation and the forward hooks a user put on the model")

#: Attention implementations whose K/V are sdpa's bit for bit (``vkv_paged`` copies the blocks and
#: runs sdpa; ``None``: not set, transformers' default): a store filled under one serves the others.
SDPA_EXACT_ATTENTION = (None, "sdpa", "vkv_paged")


def computation_state(model: torch.nn.Module) -> dict[str, Any]:
    """What changes the K/V a model computes besides its parameters: its adapter layers' state
    (``"adapters"``: :func:`adapter_state`), the forward hooks a user put on it (``"hooks"``, by
    their handles; not :data:`LIBRARY_HOOKS`') and an attention implementation whose outputs differ from sdpa's in their
    last bits (``"attention"``: eager's, the cascade's, ...; each layer's K/V after the first are
    computed from the attention before them). Empty for a model without adapter layers or user
    hooks whose attention is sdpa's (:data:`SDPA_EXACT_ATTENTION`)."""
    return _state_of(model, *_walk(model)[1:3])


def _state_of(model: torch.nn.Module, adapters: list[list[Any]], hooks: list[list[int]]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if adapters:
        state["adapters"] = adapters
    if hooks:
        state["hooks"] = hooks
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention not in SDPA_EXACT_ATTENTION:
        state["attention"] = str(attention)
    return state


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """What the model's weights compute: the sha256 (hex) over every parameter's name, shape and
    sampled values (as float32: all of them up to ``_SAMPLE``, else ``_BLOCKS`` runs of
    consecutive values evenly spaced from the first value to the last, ``_SAMPLE`` in all), and
    where :func:`computation_state` is not empty (adapter layers, user hooks, an attention other
    than sdpa's) or the model has buffers the sha256 of that, the state and the buffers' digest
    (their names, shapes and samples, as the parameters'). ``model``: :func:`unwrapped` first.
    A model cast to another dtype fingerprints differently: check the dtype first. A parameter on
    the ``meta`` device (offloaded by accelerate) is :class:`~hf_vkv.PrefixMismatchError`
    (``field="weights"``): there are no values to read.

    Taken anew at each use: nothing cheaper tells that a parameter did not change (a write
    through ``param.data``, which an adapter's merge does, bumps no version counter). What it
    costs is mostly reading memory that the processor's caches and TLB no longer hold: a run of
    32 values lies in one or two cache lines of one page, where 32 evenly spaced values of a large
    tensor lie in up to 32 pages (the embedded SmolLM2's fingerprint 0.3 s after the last call:
    8.9 ms against 17.4 ms for 256 evenly spaced values at one thread, 10.1 against 15.2 ms at
    two; ``benchmarks/prefix_files.py``). The fingerprints earlier versions wrote
    (:func:`earlier_fingerprints`) still match."""
    return weights_identity(model)[0]


def earlier_fingerprints(model: torch.nn.Module) -> tuple[str, str]:
    """The weights fingerprints earlier hf_vkv versions wrote for ``model`` (files that carry one
    still load for it, :func:`weights_match`): ``_SAMPLE`` evenly spaced values of each tensor
    with the buffers, and without them (before buffers were sampled)."""
    return (weights_identity(model, blocks=_SAMPLE)[0], weights_identity(model, buffers=False, blocks=_SAMPLE)[0])


class TensorsSeen:
    """Which tensor objects a model's parameters and buffers were, and their version counters, at
    one time in this process (:func:`weights_identity`). Equal to a later one where every tensor
    is the same object (alive: a weak reference, so the id of a tensor that was replaced and
    freed is never taken for its successor's) with the same counter: no tensor was replaced
    (``module.weight = ...``, a second round of ``torch.nn.utils.prune`` replacing a mask) or
    written in place since."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._refs = tuple(weakref.ref(t) for t in tensors)
        self._versions = tuple(t._version for t in tensors)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorsSeen):
            return NotImplemented
        return self._versions == other._versions and len(self._refs) == len(other._refs) and all(
            a() is not None and a() is b() for a, b in zip(self._refs, other._refs))


@torch.no_grad()
def weights_identity(model: torch.nn.Module, *, buffers: bool = True, blocks: int = _BLOCKS) -> tuple[str, TensorsSeen]:
    """``(weights_fingerprint(model), seen)`` in one walk: ``seen`` (:class:`TensorsSeen`) holds
    which tensors its parameters and buffers are and their version counters, in this process
    (another process, or a copy of the model, has its own). Torch bumps a tensor's counter at
    every in-place write through it (an optimizer step, ``load_state_dict``, ``param[i] += x``
    under ``torch.no_grad()``), so an equal ``seen`` later says no parameter or buffer was
    written that way or replaced since, where the sampled fingerprint sees only the values it
    samples (a write through ``param.data`` bumps nothing: the samples are what see a merge).
    A model with weights packed outside its parameters and buffers (torch.ao's dynamic
    quantization) is :class:`~hf_vkv.PrefixMismatchError` (``field="weights"``): nothing cheap
    reads them, and two such models with other weights would fingerprint alike. ``buffers`` and
    ``blocks``: the fingerprints of earlier versions (:func:`earlier_fingerprints`)."""
    model = unwrapped(model)
    params, adapters, hooks, held, packed = _walk(model)
    if packed:
        more = f" and {len(packed) - 1} more modules" if len(packed) > 1 else ""
        raise PrefixMismatchError("weights", f"the weights cannot be fingerprinted: {packed[0]!r}{more} keep weights "
                                             f"packed outside the model's parameters and buffers (torch.ao "
                                             f"quantization), where the weights fingerprint cannot read them; generate "
                                             f"with vkv without a prefix store for this model")
    versions = TensorsSeen([param for _, param in params] + [buffer for _, buffer in held])
    digest = hashlib.sha256(b"".join(_samples(params, blocks))).hexdigest()
    state = _state_of(model, adapters, hooks)
    if buffers and held:
        state["buffers"] = hashlib.sha256(b"".join(_samples(held, blocks))).hexdigest()
    if not state:
        return digest, versions
    return hashlib.sha256((digest + json.dumps(state, sort_keys=True)).encode()).hexdigest(), versions


def weights_match(saved: str, model: torch.nn.Module, current: str | None = None) -> bool:
    """Whether a file's weights fingerprint ``saved`` is ``model``'s (``current``: its
    :func:`weights_fingerprint`, if known), or one an earlier hf_vkv wrote for it
    (:func:`earlier_fingerprints`: taken only when the current one differs)."""
    return saved == (current or weights_fingerprint(model)) or saved in earlier_fingerprints(model)


def _samples(tensors: list[tuple[str, torch.Tensor]], blocks: int) -> list[bytes]:
    """Per tensor, by name: its header (name, shape) and its sample (:func:`_sample_index`) as float32."""
    parts: list[bytes] = []  # hashed at once: the same digest as an update per part, fewer calls
    for name, tensor in sorted(tensors, key=_name_of):
        values = tensor.detach()
        if type(values) is torch.Tensor and values.device == _CPU and values.dtype in _NUMPY_DTYPES:
            # fewer, cheaper calls than torch's indexing (a tensor subclass, a quantized one, goes through torch)
            flat = values.numpy().reshape(-1)
            sample = flat[_sample_index(flat.size, blocks)]
            if sample.dtype != np.float32:
                sample = sample.astype(np.float32)
        elif values.device.type == "meta":
            raise PrefixMismatchError("weights", f"the weights cannot be fingerprinted: {name!r} is on the "
                                                 f"meta device (offloaded by accelerate: {OFFLOADED}); load the model "
                                                 f"onto its device to use a prefix store with it")
        else:
            index = _sample_index(values.numel(), blocks)
            sample = values.reshape(-1)[torch.from_numpy(index).to(values.device)].float().cpu().numpy()
        parts.append(_header(name, tensor.shape))
        parts.append(sample.tobytes())
    return parts


def _name_of(item: tuple[str, Any]) -> str:
    return item[0]


@functools.lru_cache(maxsize=4096)
def _header(name: str, shape: torch.Size) -> bytes:
    """What the fingerprint hashes before a parameter's values: ``"<name>:<shape tuple>;"``."""
    return f"{name}:{tuple(shape)};".encode()


@functools.lru_cache(maxsize=512)
def _sample_index(n: int, blocks: int) -> np.ndarray:
    """The indices sampled of ``n`` values (shared: not to be written): all of them up to
    ``_SAMPLE``, else ``blocks`` runs of ``_SAMPLE // blocks`` consecutive values whose starts are
    evenly spaced from the first value to the last run's (``blocks=_SAMPLE``: evenly spaced
    values, the earlier versions' sample). In integers: a float32 linspace rounds past the end of
    a 28M-element tensor."""
    if n <= _SAMPLE:
        return np.arange(n, dtype=np.int64)
    width = _SAMPLE // blocks
    starts = np.arange(blocks, dtype=np.int64) * (n - width) // (blocks - 1)
    return (starts[:, None] + np.arange(width, dtype=np.int64)).reshape(-1)
