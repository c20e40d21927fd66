"""A zoo of tiny random-initialized models, one per architecture, for the breadth suite.

Every model is built from a config in code (no download, no tokenizer): 2 layers (a few more where
an architecture needs them to show its layer kinds), hidden size 32-64, vocabulary 128, float32 on
the CPU, in ``eval()`` mode, built once per process. ``lm_head`` is scaled up so greedy and beam
decisions are not near-ties and EOS is made rare, so every generation runs its full length.

:data:`SPECS` maps an architecture name to the classes (looked up by name in ``transformers``, so
an architecture missing from the installed version is skipped with that reason) and the config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import GenerationConfig, PreTrainedModel

VOCAB = 128
PAD, EOS, BOS = 0, 1, 2
FIRST_WORD = 3
LOGIT_SCALE = 10.0
#: A sliding window the generations here exceed (prompt 8 + 8 new tokens).
WINDOW = 6


@dataclass(frozen=True)
class Spec:
    """How to build one tiny architecture."""

    model: str  # class name in transformers
    config: str  # config class name in transformers
    kwargs: dict[str, Any] = field(default_factory=dict)
    encoder_decoder: bool = False
    depth_key: str = "num_hidden_layers"  # the config field holding the (decoder) depth


#: Llama-style config fields (most decoder-only architectures accept them).
_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, vocab_size=VOCAB)
_MHA = {**_LLAMA, "num_key_value_heads": 2}
_BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, vocab_size=VOCAB,
             decoder_start_token_id=BOS, forced_eos_token_id=None)
_T5 = dict(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
           decoder_start_token_id=PAD, relative_attention_num_buckets=8)
_MAMBA = dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, expand=2, conv_kernel=4)
#: Mixture-of-experts fields under the names the MoE families use (each takes those it knows).
_MOE = dict(num_experts=4, num_experts_per_tok=2, num_local_experts=4, moe_intermediate_size=32, n_routed_experts=4,
            shared_expert_intermediate_size=32, n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1)
_HD16 = {**_LLAMA, "head_dim": 16}
#: Multi-head latent attention (keys and values of different head dims), with experts.
_MLA = {**_MHA, "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1}
#: Mamba-2 mixers of the hybrids that name their fields mamba_* (Bamba, Granite 4).
_MAMBA2 = dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
               mamba_chunk_size=8)
#: A linear-attention layer, then a full one (Qwen3-Next's and Qwen 3.5's hybrids).
_LINEAR = {"layer_types": ["linear_attention", "full_attention"], "linear_num_value_heads": 2, "linear_num_key_heads": 1,
           "linear_key_head_dim": 8, "linear_value_head_dim": 8}

SPECS: dict[str, Spec] = {
    # ---- the usual decoder-only families (full attention)
    "llama": Spec("LlamaForCausalLM", "LlamaConfig", _LLAMA),
    "qwen2": Spec("Qwen2ForCausalLM", "Qwen2Config", _LLAMA),
    "qwen3": Spec("Qwen3ForCausalLM", "Qwen3Config", {**_LLAMA, "head_dim": 16}),
    "qwen3_moe": Spec("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                      {**_LLAMA, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32}),
    "mixtral": Spec("MixtralForCausalLM", "MixtralConfig", {**_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gemma": Spec("GemmaForCausalLM", "GemmaConfig", {**_LLAMA, "head_dim": 16}),
    "phi": Spec("PhiForCausalLM", "PhiConfig", _MHA),
    "phi3": Spec("Phi3ForCausalLM", "Phi3Config", _LLAMA),
    "gpt2": Spec("GPT2LMHeadModel", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, n_inner=64,
                                                       vocab_size=VOCAB)),
    "gpt_neox": Spec("GPTNeoXForCausalLM", "GPTNeoXConfig", _MHA),
    "gpt_bigcode": Spec("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                        dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, n_inner=64, vocab_size=VOCAB,
                             multi_query=True)),
    "opt": Spec("OPTForCausalLM", "OPTConfig", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                                    num_attention_heads=2, word_embed_proj_dim=32,
                                                    max_position_embeddings=64, vocab_size=VOCAB)),
    "olmo2": Spec("Olmo2ForCausalLM", "Olmo2Config", _LLAMA),
    "starcoder2": Spec("Starcoder2ForCausalLM", "Starcoder2Config", {**_LLAMA, "sliding_window": None}),
    "stablelm": Spec("StableLmForCausalLM", "StableLmConfig", _LLAMA),
    "cohere": Spec("CohereForCausalLM", "CohereConfig", _LLAMA),
    "granite": Spec("GraniteForCausalLM", "GraniteConfig", _LLAMA),
    "glm": Spec("GlmForCausalLM", "GlmConfig", {**_LLAMA, "head_dim": 16}),
    "smollm3": Spec("SmolLM3ForCausalLM", "SmolLM3Config", _LLAMA),
    "biogpt": Spec("BioGptForCausalLM", "BioGptConfig", dict(hidden_size=32, intermediate_size=64,
                                                             num_hidden_layers=2, num_attention_heads=2,
                                                             max_position_embeddings=64, vocab_size=VOCAB)),
    # ---- families newer than the set above (transformers 5.x), with their default layer types
    "glm4": Spec("Glm4ForCausalLM", "Glm4Config", _HD16),
    "glm4_moe": Spec("Glm4MoeForCausalLM", "Glm4MoeConfig", {**_HD16, **_MOE}),
    "qwen2_moe": Spec("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**_HD16, **_MOE}),
    "olmo3": Spec("Olmo3ForCausalLM", "Olmo3Config", _HD16),
    "flex_olmo": Spec("FlexOlmoForCausalLM", "FlexOlmoConfig", _HD16),
    "olmoe": Spec("OlmoeForCausalLM", "OlmoeConfig", {**_HD16, **_MOE}),
    "exaone4": Spec("Exaone4ForCausalLM", "Exaone4Config", _HD16),
    "ernie4_5": Spec("Ernie4_5ForCausalLM", "Ernie4_5Config", _HD16),
    "ernie4_5_moe": Spec("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", {**_HD16, **_MOE}),
    "granitemoe": Spec("GraniteMoeForCausalLM", "GraniteMoeConfig", {**_HD16, **_MOE}),
    "nemotron": Spec("NemotronForCausalLM", "NemotronConfig", _HD16),
    "helium": Spec("HeliumForCausalLM", "HeliumConfig", _HD16),
    "hunyuan_v1_dense": Spec("HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", _HD16),
    "seed_oss": Spec("SeedOssForCausalLM", "SeedOssConfig", _HD16),
    "apertus": Spec("ApertusForCausalLM", "ApertusConfig", _HD16),
    "arcee": Spec("ArceeForCausalLM", "ArceeConfig", _HD16),
    "dots1": Spec("Dots1ForCausalLM", "Dots1Config", {**_HD16, **_MOE}),
    "phimoe": Spec("PhimoeForCausalLM", "PhimoeConfig", {**_HD16, **_MOE}),
    "minimax_m2": Spec("MiniMaxM2ForCausalLM", "MiniMaxM2Config", {**_HD16, **_MOE}),
    "ministral3": Spec("Ministral3ForCausalLM", "Ministral3Config", _HD16),
    "bitnet": Spec("BitNetForCausalLM", "BitNetConfig", _HD16),
    "cohere2_moe": Spec("Cohere2MoeForCausalLM", "Cohere2MoeConfig", {**_HD16, **_MOE}),  # sliding + full
    "vaultgemma": Spec("VaultGemmaForCausalLM", "VaultGemmaConfig", _HD16),  # sliding + full, softcapping
    "diffllama": Spec("DiffLlamaForCausalLM", "DiffLlamaConfig", _MHA),  # two attention calls, values split
    # ---- per-layer configs (transformers' heterogeneous configs): Gemma 4's full-attention layers
    # have a wider head_dim (512 here) than its sliding ones (16); the second also shares its last two
    # layers' K/V with earlier layers, uses the keys as values on its full layers, and has experts
    "gemma4": Spec("Gemma4ForCausalLM", "Gemma4TextConfig", {**_HD16, "sliding_window": WINDOW}),
    "gemma4_shared_kv": Spec("Gemma4ForCausalLM", "Gemma4TextConfig",
                             {**_HD16, "sliding_window": WINDOW, "num_hidden_layers": 4,
                              "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
                              "attention_k_eq_v": True, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                              "moe_intermediate_size": 32}),
    # ---- sliding / chunked windows
    "mistral": Spec("MistralForCausalLM", "MistralConfig", {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW}),
    "ministral": Spec("MinistralForCausalLM", "MinistralConfig",
                      {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW,
                       "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma2": Spec("Gemma2ForCausalLM", "Gemma2Config", {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW,
                                                         "query_pre_attn_scalar": 16}),
    "gemma3": Spec("Gemma3ForCausalLM", "Gemma3TextConfig",
                   {**_LLAMA, "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    "cohere2": Spec("Cohere2ForCausalLM", "Cohere2Config",
                    {**_LLAMA, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}),
    "llama4": Spec("Llama4ForCausalLM", "Llama4TextConfig",
                   {**_LLAMA, "head_dim": 16, "intermediate_size_mlp": 64, "num_local_experts": 2,
                    "attention_chunk_size": WINDOW, "no_rope_layers": [1, 0], "interleave_moe_layer_step": 2}),
    # ---- MLA (keys and values of different head dims)
    "deepseek_v3": Spec("DeepseekV3ForCausalLM", "DeepseekV3Config", _MLA),
    # ---- attention sinks
    "gpt_oss": Spec("GptOssForCausalLM", "GptOssConfig",
                    {**_LLAMA, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                     "layer_types": ["sliding_attention", "full_attention"]}),
    # ---- hybrids: attention layers beside linear / recurrent state
    "falcon_h1": Spec("FalconH1ForCausalLM", "FalconH1Config",
                      {**_LLAMA, "head_dim": 16, "mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8,
                       "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8}),
    "zamba2": Spec("Zamba2ForCausalLM", "Zamba2Config",
                   dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                        attention_head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, mamba_d_state=8,
                        mamba_headdim=8, n_mamba_heads=8, mamba_ngroups=1, intermediate_size=64,
                        layers_block_type=["mamba", "hybrid"], num_mem_blocks=1, use_mem_rope=True,
                        adapter_rank=4, chunk_size=8)),
    "jamba": Spec("JambaForCausalLM", "JambaConfig",
                  {**_LLAMA, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                   "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
                   "mamba_expand": 2, "use_mamba_kernels": False}),
    "lfm2": Spec("Lfm2ForCausalLM", "Lfm2Config", {**_LLAMA, "full_attn_idxs": [1], "conv_L_cache": 3}),
    "qwen3_next": Spec("Qwen3NextForCausalLM", "Qwen3NextConfig",
                       {**_LLAMA, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                        "linear_num_value_heads": 2, "linear_num_key_heads": 1, "linear_key_head_dim": 8,
                        "linear_value_head_dim": 8, "num_experts": 2, "num_experts_per_tok": 1,
                        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "nemotron_h": Spec("NemotronHForCausalLM", "NemotronHConfig",
                       {**_HD16, **_MOE, "layers_block_type": ["linear_attention", "full_attention"],
                        "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 1,
                        "chunk_size": 8, "moe_shared_expert_intermediate_size": 32}),
    "olmo_hybrid": Spec("OlmoHybridForCausalLM", "OlmoHybridConfig", _HD16),
    # ---- compressed attention vkv does not store (DeepSeek-V4: transformers' cache, one warning)
    "deepseek_v4": Spec("DeepseekV4ForCausalLM", "DeepseekV4Config", _HD16),
    "qwen3_5": Spec("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {**_HD16, **_LINEAR}),
    "qwen3_5_moe": Spec("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {**_HD16, **_LINEAR, **_MOE}),
    "lfm2_moe": Spec("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
                     {**_HD16, **_MOE, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1}),
    "granitemoehybrid": Spec("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                             {**_HD16, **_MOE, **_MAMBA2, "layer_types": ["mamba", "attention"]}),
    "bamba": Spec("BambaForCausalLM", "BambaConfig", {**_HD16, **_MAMBA2, "attn_layer_indices": [1]}),
    "recurrent_gemma": Spec("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                            {**_HD16, "block_types": ["recurrent", "attention"], "lru_width": 32,
                             "attention_window_size": 16, "conv1d_width": 4}),
    # ---- Gemma 3n: AltUp, Laurel and per-layer inputs around sliding and full attention
    "gemma3n": Spec("Gemma3nForCausalLM", "Gemma3nTextConfig",
                    {**_HD16, "num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": WINDOW, "laurel_rank": 4, "altup_num_inputs": 2,
                     "hidden_size_per_layer_input": 8, "activation_sparsity_pattern": [0.0, 0.0]}),
    # ---- more MLA (DeepSeek-V2, Mistral 4; Kimi-Linear beside linear attention)
    "deepseek_v2": Spec("DeepseekV2ForCausalLM", "DeepseekV2Config", _MLA),
    "mistral4": Spec("Mistral4ForCausalLM", "Mistral4Config", _MLA),
    "kimi_linear": Spec("KimiLinearForCausalLM", "KimiLinearConfig",
                        {**_MLA, "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                                                        "head_dim": 8, "short_conv_kernel_size": 4}}),
    # ---- no attention at all
    "mamba": Spec("MambaForCausalLM", "MambaConfig", _MAMBA),
    "falcon_mamba": Spec("FalconMambaForCausalLM", "FalconMambaConfig", _HD16),
    # ---- attention code of their own (not transformers' AttentionInterface)
    "mpt": Spec("MptForCausalLM", "MptConfig", dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                                                    vocab_size=VOCAB, expansion_ratio=2)),
    "bloom": Spec("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=2, vocab_size=VOCAB)),
    "codegen": Spec("CodeGenForCausalLM", "CodeGenConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                                rotary_dim=8, n_inner=64, vocab_size=VOCAB)),
    "gptj": Spec("GPTJForCausalLM", "GPTJConfig", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, rotary_dim=8,
                                                       n_inner=64, vocab_size=VOCAB)),
    "falcon": Spec("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                             num_attention_heads=2, vocab_size=VOCAB,
                                                             new_decoder_architecture=True, num_kv_heads=1)),
    "gpt_neo": Spec("GPTNeoForCausalLM", "GPTNeoConfig",
                    dict(hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=64, intermediate_size=64,
                         attention_types=[[["global", "local"], 1]], window_size=WINDOW, vocab_size=VOCAB)),
    "xglm": Spec("XGLMForCausalLM", "XGLMConfig", dict(d_model=32, num_layers=2, attention_heads=2, ffn_dim=64,
                                                       max_position_embeddings=64, vocab_size=VOCAB)),
    # ---- encoder-decoder
    "bart": Spec("BartForConditionalGeneration", "BartConfig", _BART, encoder_decoder=True, depth_key="decoder_layers"),
    "t5": Spec("T5ForConditionalGeneration", "T5Config", _T5, encoder_decoder=True),
    # sequence-first activations inside ([T, B, C]: FSMT's layers, fairseq's layout)
    "fsmt": Spec("FSMTForConditionalGeneration", "FSMTConfig",
                 {**{k: v for k, v in _BART.items() if k not in ("vocab_size", "forced_eos_token_id")},
                  "src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB, "langs": ["en", "de"]},
                 encoder_decoder=True, depth_key="decoder_layers"),
    # a head that reads the decoder's n-gram streams (last_hidden_state_ngram), not its last hidden state
    "prophetnet": Spec("ProphetNetForConditionalGeneration", "ProphetNetConfig",
                       dict(hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
                            num_decoder_layers=2, num_encoder_attention_heads=2, num_decoder_attention_heads=2,
                            vocab_size=VOCAB, max_position_embeddings=64, decoder_start_token_id=BOS, ngram=2),
                       encoder_decoder=True, depth_key="num_decoder_layers"),
}


class ArchitectureMissing(Exception):
    """The installed transformers has no such model or config class."""


def _seeded_build(spec: Spec, attn: str | None, seed: int = 0) -> PreTrainedModel:
    config_cls = getattr(transformers, spec.config, None)
    model_cls = getattr(transformers, spec.model, None)
    if config_cls is None or model_cls is None:
        raise ArchitectureMissing(
            f"transformers {transformers.__version__} has no {spec.model if model_cls is None else spec.config}")
    ids = dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, tie_word_embeddings=False)
    config = config_cls(**ids, **spec.kwargs)
    if attn is not None:
        config._attn_implementation = attn
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return model_cls(config)
    finally:
        torch.random.set_rng_state(state)


@functools.cache
def tiny(arch: str, depth: int | None = None) -> PreTrainedModel:
    """The tiny ``arch`` model with its own (default) attention (``depth`` overrides its number of
    (decoder) layers, with other weights: an assistant); raises :class:`ArchitectureMissing`."""
    spec = SPECS[arch]
    if depth is not None:
        spec = dataclasses.replace(spec, kwargs={**spec.kwargs, spec.depth_key: depth})
    model = _seeded_build(spec, None, seed=0 if depth is None else 1).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(LOGIT_SCALE)
        head[EOS].mul_(1 / LOGIT_SCALE**2)
    model.generation_config = GenerationConfig(
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        **({"decoder_start_token_id": spec.kwargs["decoder_start_token_id"]} if spec.encoder_decoder else {}),
    )
    return model


def build_with_attention(arch: str, attn: str) -> PreTrainedModel:
    """A fresh (untrained, unscaled) ``arch`` model built with ``attn`` in its config: for checks of
    what happens at construction."""
    return _seeded_build(SPECS[arch], attn)


def prompts(batch: int = 2, length: int = 8, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids ``[batch, length]`` with left padding (row ``i`` padded by ``3 * i`` tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_WORD, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        ids[row, : 3 * row] = PAD
        mask[row, : 3 * row] = 0
    return {"input_ids": ids, "attention_mask": mask}
