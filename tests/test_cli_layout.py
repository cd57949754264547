"""``pdbroker layout`` prints rank 0's page as vLLM 0.33 allocates it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.cli import main
from broker.presets import PRESET_CONFIGS, resolve_model


def layout(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["layout", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # exactly one JSON object


def test_nemotron_h_8b_tp1(capsys: pytest.CaptureFixture[str]) -> None:
    out = layout(capsys, "--model", "nemotron-h-8b", "--tp", "1")
    assert out["block_size"] == 1040 and out["kernel_block_size"] == 1040
    assert out["page_bytes"] == 4259840
    assert out["mamba"].pop("segments")[-1] == {
        "tensor": "ssm",
        "offset": 61440,
        "bytes": 4194304,
        "shape": [128, 64, 128],
        "dtype": "float32",
        "shard": {"axis": 0, "start": 0, "end": 128, "global_extent": 128},
    }
    assert out["mamba"] == {
        "conv_segments": [[0, 49152], [49152, 6144], [55296, 6144]],
        "ssm_offset": 61440,
        "ssm_bytes": 4194304,
        "padding_bytes": 4096,
    }
    model = resolve_model("nemotron-h-8b")
    assert out["groups"] == [
        {"type": kind.value, "layers": list(names)} for kind, names in model.groups
    ]


def test_nemotron_h_8b_tp4(capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON holds what the text shows: model, TP, regions, the attention page and every
    Mamba segment with its shard of the global tensor."""
    out = layout(capsys, "--model", "nemotron-h-8b", "--tp", "4")
    assert out["model"].startswith("nemotron-h-8b:")
    assert (out["tp"], out["rank"], out["regions"]) == (4, 0, 4)
    assert (out["block_size"], out["page_bytes"]) == (1040, 1064960)
    assert out["attention"] == {
        "kernel_blocks_per_page": 1,
        "kernel_block_bytes": 1064960,
        "segments": [
            {
                "tensor": "kv",
                "offset": 0,
                "bytes": 1064960,
                "shape": [2, 1040, 256],
                "dtype": "bfloat16",
                "shard": {"axis": 0, "start": 0, "end": 2, "global_extent": 8},
            }
        ],
    }
    segments = out["mamba"].pop("segments")
    assert [(s["tensor"], s["offset"], s["bytes"]) for s in segments] == [
        ("conv.x", 0, 12288),
        ("conv.B", 12288, 1536),
        ("conv.C", 13824, 1536),
        ("ssm", 15360, 1048576),
    ]
    assert [s["shard"]["global_extent"] for s in segments] == [8192, 1024, 1024, 128]
    assert out["mamba"] == {
        "conv_segments": [[0, 12288], [12288, 1536], [13824, 1536]],
        "ssm_offset": 15360,
        "ssm_bytes": 1048576,
        "padding_bytes": 1024,
    }


def test_qwen35_27b_tp8(capsys: pytest.CaptureFixture[str]) -> None:
    out = layout(capsys, "--model", "qwen3.5-27b", "--tp", "8")
    mamba = out["mamba"]
    assert mamba["conv_segments"] == [[0, 1536], [1536, 1536], [3072, 4608]]
    assert (mamba["ssm_offset"], mamba["ssm_bytes"]) == (7680, 6 * 128 * 128 * 4)
    assert out["page_bytes"] == out["block_size"] * 2 * 1 * 256 * 2  # 4 KV heads replicated
    assert mamba["padding_bytes"] == out["page_bytes"] - 7680 - mamba["ssm_bytes"] >= 0


def test_block_sizes_and_kv_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    out = layout(capsys, "--model", "nemotron-h-8b", "--kernel-block-size", "16")
    assert (out["block_size"], out["kernel_block_size"], out["page_bytes"]) == (1040, 16, 4259840)
    out = layout(capsys, "--model", "nemotron-h-8b", "--block-size", "2048")
    assert out["page_bytes"] == 2048 * 4096
    assert out["mamba"]["padding_bytes"] == 2048 * 4096 - 61440 - 4194304
    # fp8 halves the bytes per token, so HMA doubles the block size.
    out = layout(capsys, "--model", "nemotron-h-8b", "--kv-dtype", "fp8")
    assert (out["block_size"], out["page_bytes"]) == (2080, 2080 * 2 * 8 * 128)
    assert out["mamba"]["padding_bytes"] == 2080 * 2 * 8 * 128 - 61440 - 4194304


def test_hf_config_matches_the_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PRESET_CONFIGS["nemotron-3-nano-30b-a3b"]))
    from_file = layout(capsys, "--hf-config", str(config), "--tp", "2")
    from_dir = layout(capsys, "--hf-config", str(tmp_path), "--tp", "2")
    preset = layout(capsys, "--model", "nemotron-3-nano-30b-a3b", "--tp", "2")
    # The name comes from the file's directory; the fingerprint after it from the layout.
    fingerprints = {out.pop("model").split(":")[1] for out in (from_file, from_dir, preset)}
    assert len(fingerprints) == 1
    assert from_file == from_dir == preset
    assert [len(g["layers"]) for g in preset["groups"]] == [6, 6, 6, 5, 6]


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--model", "nemotron-h-8b"]) == 0
    text = capsys.readouterr().out
    for expected in (
        "1,040 tokens",
        "4,259,840",
        "conv.x",
        "(128, 64, 128)",
        "float32",
        "4,096  padding",
        "model.layers.7.mixer.attn",
    ):
        assert expected in text


def test_text_output_of_replicated_latents_and_block_rows(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """MLA's latent is whole on every rank; DeepSeek-V4's block rows show, per group, its
    blocks, window and the bytes its layers' pages use of each row."""
    assert main(["layout", "--model", "deepseek-v2-lite", "--tp", "2"]) == 0
    assert "each latent (1, 16, 576) bfloat16 (whole on every rank)" in capsys.readouterr().out
    assert main(["layout", "--model", "deepseek-v4-flash", "--kv-dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "block rows of 891,392 bytes" in text
    assert "256-token blocks, window     -:  62 layer pages, 886,016 bytes per block" in text
    assert "4-token blocks, window     8:  42 layer pages, 860,160 bytes per block" in text
    assert main(["layout", "--model", "deepseek-v4-flash", "--kv-dtype", "fp8_ds_mla"]) == 0
    text = capsys.readouterr().out
    # Packed latents: 584 bytes per entry, every page padded to 576 bytes.
    assert "block rows of 1,002,240 bytes" in text
    assert "256-token blocks, window     -:  62 layer pages, 985,664 bytes per block" in text


@pytest.mark.parametrize(
    "args,field",
    [
        (["--model", "no-such-model"], "model"),
        (["--model", "deepseek-v4-flash", "--kv-dtype", "nvfp4_ds_mla"], "kv_dtype"),
        (["--model", "nemotron-h-8b", "--block-size", "64"], "block_size"),
        (
            ["--model", "nemotron-h-8b", "--block-size", "1040", "--kernel-block-size", "48"],
            "kernel_block_size",
        ),
        (["--model", "qwen3.5-27b", "--tp", "3"], "mamba.conv.Q"),
        (["--hf-config", "/nonexistent/config.json"], "hf_config"),
    ],
)
def test_errors_name_the_field(
    args: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["layout", *args]) == 2
    assert f"pdbroker layout: error: {field}: " in capsys.readouterr().err
