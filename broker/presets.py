"""Model presets and Hugging Face ``config.json`` parsing into :class:`ModelSpec`.

Presets are the public ``config.json`` values of each model (only the fields read here), so
a preset and a user's config file go through the same parser. These families are understood:

- Nemotron-H (``model_type`` ``nemotron_h``): Mamba2 + attention, layer mix from
  ``hybrid_override_pattern`` (``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE) or the
  ``layers_block_type`` list of newer configs; every attention layer in the config's
  ``sliding_window`` when it sets one.
- Qwen3-Next / Qwen3.5 (``qwen3_next``, ``qwen3_5*``): Gated DeltaNet ("linear_attention")
  + full attention, from ``layer_types`` or ``full_attention_interval``; Qwen3.5 keeps its
  text model under ``text_config``.
- Jamba (``jamba``): Mamba1 + attention, from ``attn_layer_period`` / ``attn_layer_offset``.
- Llama (``llama``): full attention in every layer, no Mamba state.
- DeepSeek-V2/V3 (``deepseek_v2``, ``deepseek_v3``): multi-head latent attention (MLA) in
  every layer, one ``kv_lora_rank + qk_rope_head_dim`` latent per token.
- gpt-oss (``gpt_oss``): sliding-window (``sliding_window`` tokens) and full attention in
  alternate layers, no Mamba state.
- Kimi-Linear (``kimi_linear``): Kimi Delta Attention (KDA, a Gated DeltaNet) in the layers
  ``linear_attn_config.kda_layers`` numbers (from 1), MLA in the others.
- DeepSeek-V4 (``deepseek_v4``): per layer a sliding-window latent cache, and for layers of
  compress ratio 4 or 128 (``compress_ratios``, or ``layer_types`` and ``compress_rates``)
  a compressed latent, its compressor's state and (ratio 4) indexer keys with their
  compressor's state; vLLM packs them block-outermost (:mod:`broker.row_models`).

State dtypes follow vLLM 0.33 with ``--mamba-cache-dtype auto --mamba-ssm-cache-dtype
auto``: conv state and KV cache in the model dtype; SSM state from the config's
``mamba_ssm_cache_dtype`` for Nemotron-H (float32 when absent,
``NemotronHForCausalLMConfig``), from ``mamba_ssm_dtype`` for Qwen3.5
(``Qwen3_5ForConditionalGenerationConfig``), otherwise the model dtype.

Layers are named as vLLM registers them in its forward context and grouped the way its hybrid
KV-cache manager groups them (:func:`vllm_kv_cache_groups`). Only :func:`load_hf_config` reads
files (:func:`model_from_hf_file` and :func:`resolve_model` go through it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from broker.errors import LayoutError
from broker.layout import GroupKind, dtype_bytes
from broker.models import AttentionParams, MambaParams, ModelSpec, row_model
from broker.preset_configs import PRESET_CONFIGS
from broker.row_models import RowCache

#: vLLM's ``auto`` model dtype keeps these checkpoint dtypes and downcasts anything else
#: (float32, or no dtype at all) to bfloat16.
_KEPT_MODEL_DTYPES = ("bfloat16", "float16")


def vllm_kv_cache_groups(
    layers: Sequence[tuple[str, GroupKind]], windows: Mapping[str, int] | None = None
) -> tuple[tuple[GroupKind, tuple[str, ...]], ...]:
    """KV-cache groups as vLLM 0.33's hybrid allocator forms them from ``layers`` (name, kind)
    in model (registration) order (``_get_kv_cache_groups_uniform_page_size`` in
    ``vllm/v1/core/kv_cache_planning.py``).

    Layers are bucketed by KV-cache spec, which here means by kind and sliding window
    (``windows``: layer name -> tokens, for sliding-window layers), buckets ordered by first
    appearance. The group size is the
    smallest bucket's length, or the largest's when that is under 1.5x the smallest; each
    bucket splits into ``ceil(len / group_size)`` groups and group *i* takes every
    ``n``-th layer starting at *i* (``layers[i::n]``), so the last groups may be one short.
    """
    buckets: dict[tuple[GroupKind, int], list[str]] = {}
    for name, kind in layers:
        buckets.setdefault((kind, (windows or {}).get(name, 0)), []).append(name)
    if not buckets:
        raise LayoutError("layers", "the model has no KV-carrying layer")
    sizes = [len(names) for names in buckets.values()]
    smallest, largest = min(sizes), max(sizes)
    group_size = largest if 2 * largest < 3 * smallest else smallest
    groups: list[tuple[GroupKind, tuple[str, ...]]] = []
    for (kind, _), names in buckets.items():
        count = -(-len(names) // group_size)
        groups.extend((kind, tuple(names[i::count])) for i in range(count))
    return tuple(groups)


def preset_names() -> tuple[str, ...]:
    """Names :func:`resolve_model` accepts besides config paths."""
    return tuple(PRESET_CONFIGS)


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or the model of a Hugging Face ``config.json`` (file or directory)."""
    if name_or_path in PRESET_CONFIGS:
        return model_from_hf_config(PRESET_CONFIGS[name_or_path], name_or_path)
    path = Path(name_or_path)
    if path.exists():
        return model_from_hf_file(path)
    raise LayoutError(
        "model",
        f"unknown preset {name_or_path!r}; valid presets: "
        f"{', '.join(preset_names())}, or a path to a config.json",
    )


def load_hf_config(path: Path) -> dict[str, Any]:
    """Read ``path`` (a ``config.json`` or a directory holding one) as a JSON object."""
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError("hf_config", f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict):
        raise LayoutError("hf_config", f"{file} does not hold a JSON object")
    return config


def model_from_hf_file(path: Path) -> ModelSpec:
    """The model of a ``config.json`` (or its directory), named after that directory."""
    name = path.name if path.is_dir() else path.resolve().parent.name
    return model_from_hf_config(load_hf_config(path), name)


def model_from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from a Hugging Face config dict; raises :class:`LayoutError`
    naming the offending field (dotted, e.g. ``text_config.linear_num_key_heads``)."""
    model_type = config.get("model_type")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise LayoutError(
            "model_type", f"unsupported {model_type!r}; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return family(config, name)


def _get(config: Mapping[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise LayoutError(f"{where}{key}", "missing")
    return config[key]


def _positive_int(
    config: Mapping[str, Any], key: str, where: str, default: int | None = None
) -> int:
    value = config.get(key, default) if default is not None else _get(config, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayoutError(f"{where}{key}", f"must be a positive integer, got {value!r}")
    return value


def _first_key(config: Mapping[str, Any], *keys: str) -> str:
    """The first of ``keys`` the config sets (configs spell some fields two ways)."""
    return next((key for key in keys if config.get(key) is not None), keys[0])


def _dtype_name(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise LayoutError(field, f"must be a dtype name, got {value!r}")
    name = value.removeprefix("torch.")
    dtype_bytes(name, field)
    return name


def _model_dtype(*sources: tuple[Mapping[str, Any], str]) -> str:
    """vLLM's ``auto`` model dtype from the first source that names one: the checkpoint's
    bfloat16/float16 as is, anything else (float32, or none at all) as bfloat16."""
    for config, where in sources:
        key = _first_key(config, "dtype", "torch_dtype")
        if config.get(key) is not None:
            name = _dtype_name(config[key], f"{where}{key}")
            return name if name in _KEPT_MODEL_DTYPES else "bfloat16"
    return "bfloat16"


def _hidden_per_head(config: Mapping[str, Any], where: str) -> int:
    hidden = _positive_int(config, "hidden_size", where)
    heads = _positive_int(config, "num_attention_heads", where)
    if hidden % heads:
        raise LayoutError(f"{where}hidden_size", f"{hidden} is not divisible by {heads} heads")
    return hidden // heads


def _head_dim(config: Mapping[str, Any], where: str) -> int:
    """``head_dim`` (Nemotron-H-8B spells it ``attention_head_dim``), else hidden / heads."""
    key = _first_key(config, "head_dim", "attention_head_dim")
    if config.get(key) is not None:
        return _positive_int(config, key, where)
    return _hidden_per_head(config, where)


def _attention(config: Mapping[str, Any], where: str, dtype: str) -> AttentionParams:
    return AttentionParams(
        _positive_int(config, "num_key_value_heads", where), _head_dim(config, where), dtype
    )


def _spec(
    name: str,
    layers: list[tuple[str, GroupKind]],
    attention: AttentionParams,
    mamba: MambaParams,
    windows: Mapping[str, int] | None = None,
) -> ModelSpec:
    """``windows``: layer name -> sliding window (tokens) of the sliding-window layers."""
    kinds = {kind for _, kind in layers}
    groups = vllm_kv_cache_groups(layers, windows)
    return ModelSpec(
        name,
        groups,
        attention if GroupKind.ATTENTION in kinds else None,
        mamba if GroupKind.MAMBA in kinds else None,
        tuple(windows.get(names[0], 0) for _, names in groups) if windows else (),
    )


#: Nemotron-H layer codes and ``layers_block_type`` names -> KV kind (None: no KV state).
_NEMOTRON_CODES: dict[str, GroupKind | None] = {
    "M": GroupKind.MAMBA,
    "*": GroupKind.ATTENTION,
    "-": None,
    "E": None,
}
_NEMOTRON_BLOCKS: dict[str, GroupKind | None] = {
    "mamba": GroupKind.MAMBA,
    "attention": GroupKind.ATTENTION,
    "mlp": None,
    "moe": None,
}


def _nemotron_kinds(config: Mapping[str, Any]) -> list[GroupKind | None]:
    if config.get("hybrid_override_pattern") is None and config.get("layers_block_type"):
        field, table, entries = "layers_block_type", _NEMOTRON_BLOCKS, config["layers_block_type"]
    else:
        field, table = "hybrid_override_pattern", _NEMOTRON_CODES
        entries = _get(config, field, "")
    if not isinstance(entries, (str, list)) or not entries:
        raise LayoutError(field, "must be a non-empty pattern")
    kinds = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str) or entry not in table:
            raise LayoutError(
                f"{field}[{i}]", f"unknown layer type {entry!r}; expected one of {', '.join(table)}"
            )
        kinds.append(table[entry])
    return kinds


def _nemotron_h(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Nemotron-H: vLLM registers ``model.layers.{i}.mixer`` (Mamba2) and
    ``model.layers.{i}.mixer.attn`` (attention), every attention layer with the config's
    ``sliding_window`` when it sets one."""
    dtype = _model_dtype((config, ""))
    names = {
        GroupKind.MAMBA: "model.layers.{}.mixer",
        GroupKind.ATTENTION: "model.layers.{}.mixer.attn",
    }
    layers = [
        (names[kind].format(i), kind)
        for i, kind in enumerate(_nemotron_kinds(config))
        if kind is not None
    ]
    heads = _positive_int(config, "mamba_num_heads", "")
    head_dim = _positive_int(config, "mamba_head_dim", "")
    ssm_key = "mamba_ssm_cache_dtype"
    conv_kernel = _positive_int(config, _first_key(config, "conv_kernel", "mamba_d_conv"), "")
    mamba = MambaParams(
        "mamba2",
        conv_kernel=conv_kernel,
        conv_dtype=dtype,
        ssm_dtype=_dtype_name(config[ssm_key], ssm_key) if config.get(ssm_key) else "float32",
        intermediate_size=heads * head_dim,
        num_heads=heads,
        head_dim=head_dim,
        n_groups=_positive_int(config, _first_key(config, "n_groups", "mamba_n_groups"), ""),
        state_size=_positive_int(config, "ssm_state_size", ""),
    )
    window = _positive_int(config, "sliding_window", "") if config.get("sliding_window") else 0
    windows = {n: window for n, kind in layers if kind is GroupKind.ATTENTION} if window else None
    return _spec(name, layers, _attention(config, "", dtype), mamba, windows)


_QWEN_KINDS = {"linear_attention": GroupKind.MAMBA, "full_attention": GroupKind.ATTENTION}


def _qwen_kinds(text: Mapping[str, Any], where: str) -> list[GroupKind]:
    """From ``layer_types``, else every ``full_attention_interval``-th layer (default 4) is
    full attention, as the Hugging Face config classes fill it in."""
    count = _positive_int(text, "num_hidden_layers", where)
    types = text.get("layer_types")
    if types is None:
        interval = _positive_int(text, "full_attention_interval", where, default=4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(count)
        ]
    if not isinstance(types, list) or len(types) < count:
        raise LayoutError(f"{where}layer_types", f"needs one entry per layer ({count})")
    kinds = []
    for i, kind in enumerate(types[:count]):
        if not isinstance(kind, str) or kind not in _QWEN_KINDS:
            raise LayoutError(
                f"{where}layer_types[{i}]",
                f"unknown layer type {kind!r}; expected one of {', '.join(_QWEN_KINDS)}",
            )
        kinds.append(_QWEN_KINDS[kind])
    return kinds


def _qwen_gdn(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Qwen3-Next / Qwen3.5: vLLM registers ``{prefix}.layers.{i}.linear_attn`` (GDN) and
    ``{prefix}.layers.{i}.self_attn.attn``; ``prefix`` is ``language_model.model`` for the
    multimodal ``*ForConditionalGeneration`` checkpoints, ``model`` otherwise. Only the Qwen3.5
    architectures read ``mamba_ssm_dtype``."""
    nested = isinstance(config.get("text_config"), Mapping)
    text, where = (config["text_config"], "text_config.") if nested else (config, "")
    architectures = config.get("architectures") or []
    multimodal = any(str(a).endswith("ForConditionalGeneration") for a in architectures) or (
        nested and not architectures
    )
    prefix = "language_model.model" if multimodal else "model"
    names = {
        GroupKind.MAMBA: prefix + ".layers.{}.linear_attn",
        GroupKind.ATTENTION: prefix + ".layers.{}.self_attn.attn",
    }
    layers = [(names[kind].format(i), kind) for i, kind in enumerate(_qwen_kinds(text, where))]
    dtype = _model_dtype((text, where), (config, ""))
    ssm_dtype = dtype
    if str(config.get("model_type")).startswith("qwen3_5") and text.get("mamba_ssm_dtype"):
        ssm_dtype = _dtype_name(text["mamba_ssm_dtype"], f"{where}mamba_ssm_dtype")
    mamba = MambaParams(
        "gdn",
        conv_kernel=_positive_int(text, "linear_conv_kernel_dim", where),
        conv_dtype=dtype,
        ssm_dtype=ssm_dtype,
        num_k_heads=_positive_int(text, "linear_num_key_heads", where),
        num_v_heads=_positive_int(text, "linear_num_value_heads", where),
        head_k_dim=_positive_int(text, "linear_key_head_dim", where),
        head_v_dim=_positive_int(text, "linear_value_head_dim", where),
    )
    return _spec(name, layers, _attention(text, where, dtype), mamba)


def _jamba(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Jamba (Mamba1): vLLM registers ``model.layers.{i}.mixer`` and ``model.layers.{i}.attn``;
    layer *i* is attention when ``i % attn_layer_period == attn_layer_offset``. vLLM sizes its
    attention heads as hidden size / heads, whatever ``head_dim`` says."""
    dtype = _model_dtype((config, ""))
    count = _positive_int(config, "num_hidden_layers", "")
    period = _positive_int(config, "attn_layer_period", "")
    offset = _get(config, "attn_layer_offset", "")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < period:
        raise LayoutError("attn_layer_offset", f"must be in [0, {period}), got {offset!r}")
    layers = [
        (f"model.layers.{i}.attn", GroupKind.ATTENTION)
        if i % period == offset
        else (f"model.layers.{i}.mixer", GroupKind.MAMBA)
        for i in range(count)
    ]
    expand = _positive_int(config, "mamba_expand", "")
    mamba = MambaParams(
        "mamba1",
        conv_kernel=_positive_int(config, "mamba_d_conv", ""),
        conv_dtype=dtype,
        ssm_dtype=dtype,
        intermediate_size=expand * _positive_int(config, "hidden_size", ""),
        state_size=_positive_int(config, "mamba_d_state", ""),
    )
    attention = AttentionParams(
        _positive_int(config, "num_key_value_heads", ""), _hidden_per_head(config, ""), dtype
    )
    return _spec(name, layers, attention, mamba)


def _llama(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Llama: vLLM registers ``model.layers.{i}.self_attn.attn`` in every layer."""
    dtype = _model_dtype((config, ""))
    count = _positive_int(config, "num_hidden_layers", "")
    layers = [(f"model.layers.{i}.self_attn.attn", GroupKind.ATTENTION) for i in range(count)]
    return ModelSpec(name, vllm_kv_cache_groups(layers), _attention(config, "", dtype), None)


def _mla_attention(config: Mapping[str, Any], dtype: str) -> AttentionParams:
    """MLA's cache: one latent per token (the compressed KV, ``kv_lora_rank``, then the rotary
    key, ``qk_rope_head_dim``), the same on every rank."""
    return AttentionParams.mla(
        _positive_int(config, "kv_lora_rank", ""),
        _positive_int(config, "qk_rope_head_dim", ""),
        dtype,
    )


def _deepseek_mla(config: Mapping[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V2/V3: MLA in every layer, which vLLM registers as
    ``model.layers.{i}.self_attn.attn``."""
    dtype = _model_dtype((config, ""))
    count = _positive_int(config, "num_hidden_layers", "")
    layers = [(f"model.layers.{i}.self_attn.attn", GroupKind.ATTENTION) for i in range(count)]
    return ModelSpec(name, vllm_kv_cache_groups(layers), _mla_attention(config, dtype), None)


def _kimi_linear(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Kimi-Linear: KDA in the layers ``linear_attn_config.kda_layers`` numbers from 1, MLA in
    the others, as vLLM decides (``KimiLinearConfig.is_kda_layer``); vLLM registers both as
    ``model.layers.{i}.self_attn``. KDA keeps GDN's state with as many K as V heads: a conv
    over ``Q|K|V`` of ``num_heads * head_dim`` channels each, and a ``(num_heads, head_dim,
    head_dim)`` recurrent state in float32 (``kda_state_dtype`` for an ``auto`` cache dtype)."""
    where = "linear_attn_config."
    linear = _get(config, "linear_attn_config", "")
    if not isinstance(linear, Mapping):
        raise LayoutError("linear_attn_config", f"must be an object, got {linear!r}")
    count = _positive_int(config, "num_hidden_layers", "")
    for key in ("kda_layers", "full_attn_layers"):
        numbers = _get(linear, key, where)
        if not isinstance(numbers, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= count for n in numbers
        ):
            raise LayoutError(f"{where}{key}", f"must list layer numbers from 1 to {count}")
    kinds = [
        GroupKind.MAMBA if i + 1 in linear["kda_layers"] else GroupKind.ATTENTION
        for i in range(count)
    ]
    heads = _positive_int(linear, "num_heads", where)
    head_dim = _positive_int(linear, "head_dim", where)
    dtype = _model_dtype((config, ""))
    mamba = MambaParams(
        "gdn",
        conv_kernel=_positive_int(linear, "short_conv_kernel_size", where),
        conv_dtype=dtype,
        ssm_dtype="float32",
        num_k_heads=heads,
        num_v_heads=heads,
        head_k_dim=head_dim,
        head_v_dim=head_dim,
    )
    layers = [(f"model.layers.{i}.self_attn", kind) for i, kind in enumerate(kinds)]
    return _spec(name, layers, _mla_attention(config, dtype), mamba)


def _gpt_oss(config: Mapping[str, Any], name: str) -> ModelSpec:
    """gpt-oss: vLLM registers ``model.layers.{i}.attn.attn`` in every layer and gives the
    even layers a ``sliding_window`` (whatever ``layer_types`` says), the odd ones full
    attention."""
    dtype = _model_dtype((config, ""))
    count = _positive_int(config, "num_hidden_layers", "")
    window = _positive_int(config, "sliding_window", "")
    layers = [(f"model.layers.{i}.attn.attn", GroupKind.ATTENTION) for i in range(count)]
    windows = {name: window for name, _ in layers[::2]}
    groups = vllm_kv_cache_groups(layers, windows)
    return ModelSpec(
        name,
        groups,
        _attention(config, "", dtype),
        None,
        tuple(windows.get(names[0], 0) for _, names in groups),
    )


#: DeepSeek-V4's layer types and their compress ratios when ``compress_rates`` is not set
#: (``DeepseekV4Config``); a sliding-attention layer compresses nothing (ratio 0).
_DSV4_LAYER_TYPES = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_DSV4_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
#: vLLM's DeepSeek-V4 sliding-window cache blocks, and its compressor-state blocks per ratio.
_DSV4_SWA_BLOCK = 64
_DSV4_STATE_BLOCKS = {4: 4, 128: 8}
#: Values per float32 scale of the fp8 indexer keys.
_DSV4_INDEX_QUANT_BLOCK = 128


def _compress_ratios(config: Mapping[str, Any], count: int) -> tuple[str, list[Any]]:
    """The field and each layer's compress ratio, as vLLM's ``get_compress_ratios`` reads
    them: ``compress_ratios``, else ``layer_types`` through ``compress_rates``."""
    if config.get("compress_ratios") is not None:
        field, ratios = "compress_ratios", config["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < count:
            raise LayoutError(field, f"needs one ratio per layer ({count})")
        return field, ratios[:count]
    field, types = "layer_types", _get(config, "layer_types", "")
    if not isinstance(types, list) or len(types) < count:
        raise LayoutError(field, f"needs one entry per layer ({count})")
    rates = config.get("compress_rates") or _DSV4_COMPRESS_RATES
    if not isinstance(rates, Mapping):
        raise LayoutError("compress_rates", f"must be an object, got {rates!r}")
    for i, kind in enumerate(types[:count]):
        if kind not in _DSV4_LAYER_TYPES:
            raise LayoutError(
                f"{field}[{i}]",
                f"unknown layer type {kind!r}; expected one of {', '.join(_DSV4_LAYER_TYPES)}",
            )
    return field, [rates.get(kind, 0) for kind in types[:count]]


def _compressor_state(compressor: str, ratio: int, head_dim: int) -> RowCache:
    """A DeepSeek-V4 compressor's float32 kv and score state over its window, both doubled
    for ratio 4, whose windows overlap (``DeepseekCompressor``)."""
    overlap = 1 + (ratio == 4)
    return RowCache(
        f"{compressor}.state_cache",
        _DSV4_STATE_BLOCKS[ratio],
        1,
        2 * overlap * head_dim,
        "float32",
        overlap * ratio,
    )


def _deepseek_v4(config: Mapping[str, Any], name: str) -> ModelSpec:
    """DeepSeek-V4: layer *i*'s caches as vLLM registers them under
    ``model.layers.{i}.attn``: ``.swa_cache`` (the sliding-window latent, ``head_dim``
    per token); with compress ratio *r* of 4 or 128 also the compressed latent (the layer
    itself, one per *r* tokens) and ``.compressor.state_cache`` (float32 kv and score state,
    doubled for ratio 4, whose windows overlap); with ratio 4 also ``.indexer.k_cache`` (fp8
    keys of ``index_head_dim`` with a float32 scale per 128, one per 4 tokens) and
    ``.indexer.compressor.state_cache``. Latents are bfloat16 (vLLM's ``auto`` for these
    caches, whatever the model dtype); the MTP layers' caches are not the model's."""
    count = _positive_int(config, "num_hidden_layers", "")
    head_dim = _positive_int(config, "head_dim", "")
    window = _positive_int(config, "sliding_window", "")
    field, ratios = _compress_ratios(config, count)
    caches: list[RowCache] = []
    for i, ratio in enumerate(ratios):
        if ratio not in (0, 1, *_DSV4_STATE_BLOCKS) or isinstance(ratio, bool):
            raise LayoutError(
                f"{field}[{i}]", f"compress ratio {ratio!r}: vLLM serves 0 or 1 (none), 4, 128"
            )
        prefix = f"model.layers.{i}.attn"
        swa = f"{prefix}.swa_cache"
        caches.append(RowCache(swa, _DSV4_SWA_BLOCK, 1, head_dim, "bfloat16", window, latent=True))
        if ratio <= 1:
            continue
        caches += [
            RowCache(prefix, 0, ratio, head_dim, "bfloat16", latent=True),
            _compressor_state(f"{prefix}.compressor", ratio, head_dim),
        ]
        if ratio == 4:
            index_dim = _positive_int(config, "index_head_dim", "")
            keys = index_dim + index_dim // _DSV4_INDEX_QUANT_BLOCK * 4
            caches += [
                RowCache(f"{prefix}.indexer.k_cache", 0, ratio, keys, "uint8"),
                _compressor_state(f"{prefix}.indexer.compressor", ratio, index_dim),
            ]
    return row_model(name, tuple(caches))


_FAMILIES: dict[str, Callable[[Mapping[str, Any], str], ModelSpec]] = {
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen_gdn,
    "qwen3_5": _qwen_gdn,
    "qwen3_5_text": _qwen_gdn,
    "qwen3_5_moe": _qwen_gdn,
    "qwen3_5_moe_text": _qwen_gdn,
    "jamba": _jamba,
    "llama": _llama,
    "deepseek_v2": _deepseek_mla,
    "deepseek_v3": _deepseek_mla,
    "gpt_oss": _gpt_oss,
    "kimi_linear": _kimi_linear,
    "deepseek_v4": _deepseek_v4,
}
