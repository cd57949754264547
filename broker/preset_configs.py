"""The public ``config.json`` values of each preset model (only the fields
:mod:`broker.presets` reads), as data apart from the parsers that read them."""

from __future__ import annotations

from typing import Any

#: ``config.json`` fields of each preset (values from the public Hugging Face configs).
PRESET_CONFIGS: dict[str, dict[str, Any]] = {
    # nvidia/Nemotron-H-8B-Base-8K config.json.
    "nemotron-h-8b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": "bfloat16",
        "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attention_head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
    },
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json.
    "nemotron-3-nano-30b-a3b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": "bfloat16",
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "mamba_ssm_cache_dtype": "float32",
    },
    # nvidia/NVIDIA-Nemotron-3-Super-120B-A12B config.json.
    "nemotron-3-super-120b-a12b": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "dtype": "bfloat16",
        "hidden_size": 4096,
        "hybrid_override_pattern": (
            "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*"
            "EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
        ),
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "mamba_ssm_cache_dtype": "float32",
    },
    # Qwen/Qwen3.5-0.8B config.json.
    "qwen3.5-0.8b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "num_hidden_layers": 24,
            "full_attention_interval": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
        },
    },
    # Qwen/Qwen3.5-4B config.json.
    "qwen3.5-4b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "num_hidden_layers": 32,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
        },
    },
    # Qwen/Qwen3.5-27B config.json.
    "qwen3.5-27b": {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {
            "model_type": "qwen3_5_text",
            "dtype": "bfloat16",
            "num_hidden_layers": 64,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "mamba_ssm_dtype": "float32",
        },
    },
    # ai21labs/AI21-Jamba-1.5-Mini config.json.
    "jamba-1.5-mini": {
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "torch_dtype": "bfloat16",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "mamba_expand": 2,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
    },
    # deepseek-ai/DeepSeek-V2-Lite config.json.
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "torch_dtype": "bfloat16",
        "hidden_size": 2048,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    # openai/gpt-oss-20b config.json.
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": 24,
        "hidden_size": 2880,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
    },
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json.
    "kimi-linear-48b-a3b": {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "torch_dtype": "bfloat16",
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [n for n in range(1, 27) if n % 4],  # [1, 2, 3, 5, ..., 25, 26]
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
    },
    # deepseek-ai/DeepSeek-V4-Flash config.json: 43 layers, the first two sliding-window
    # only, then compress ratios 4 and 128 in turn (the last entry: the MTP layer's).
    "deepseek-v4-flash": {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_lora_rank": 1024,
        "o_groups": 8,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "sliding_window": 128,
        "num_nextn_predict_layers": 1,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
}
