"""GGUF -> HF conversion on tiny GGUFs written in llama.cpp's layout, checked against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.gguf_loader import GGUFCheckpoint, hf_tensor_name, plan_shards, unpermute_qk, write_hf_dir
from pdserve.engine.gguf_tokenizer import bytes_to_unicode
from tests.tiny_gguf import _llama_cpp_permute, write_tiny_gguf
from tests.tiny_models import make_tiny_model

GGUF_KINDS = ("llama", "qwen2")  # the llama3 tiny kind needs rope_freqs, which GGUF conversion rejects


@pytest.fixture(scope="module", params=GGUF_KINDS)
def tiny_gguf(request, tmp_path_factory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    hf_dir = make_tiny_model(request.param, root / "hf")
    return request.param, write_tiny_gguf(hf_dir, root / "tiny.gguf")


def _transformers_from_gguf(gguf_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def test_state_dict_equals_transformers_gguf_load_exactly(tiny_gguf):
    import torch

    _, path = tiny_gguf
    ours = dict(GGUFCheckpoint.open(path).iter_state_dict())
    reference = _transformers_from_gguf(path).state_dict()
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert ours[name].dtype == np.float32
        assert torch.equal(torch.from_numpy(ours[name]), tensor), name


def test_unpermuted_qk_equals_quantizing_the_hf_weights(tiny_gguf, tmp_path):
    # Q4_1/Q8_0 blocks run along a row, so a row permutation commutes with quantization:
    # undoing llama.cpp's permutation must give exactly dequant(quant(W)) of the HF weight.
    import gguf
    from safetensors.numpy import load_file

    kind, path = tiny_gguf
    hf = load_file(str(path.parent / "hf" / "model.safetensors"))
    ours = dict(GGUFCheckpoint.open(path).iter_state_dict())
    reader = gguf.GGUFReader(path)
    types = {hf_tensor_name(t.name): t.tensor_type for t in reader.tensors}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        if types[name] in (gguf.GGMLQuantizationType.F16,):
            expected = hf[name].astype(np.float16).astype(np.float32)
        else:
            expected = gguf.quants.dequantize(gguf.quants.quantize(hf[name], types[name]), types[name])
        np.testing.assert_array_equal(ours[name], expected, err_msg=f"{kind} {name}")
    # float32 tensors (norms, biases) round-trip bit for bit
    for name, value in hf.items():
        if value.ndim == 1:
            np.testing.assert_array_equal(ours[name], value)


def test_config_matches_transformers_reading_of_the_gguf(tiny_gguf):
    kind, path = tiny_gguf
    ours = GGUFCheckpoint.open(path).hf_config()
    ref = _transformers_from_gguf(path).config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == getattr(ref, key), key
    # Qwen2Config has no head_dim attribute: it derives it as hidden_size // heads
    assert ours["head_dim"] == getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads)
    assert ours["rope_parameters"]["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ours["model_type"] == ref.model_type == kind


def test_converted_dir_gives_transformers_identical_logits(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    _, path = tiny_gguf
    write_hf_dir(GGUFCheckpoint.open(path), tmp_path, progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reference = _transformers_from_gguf(path)
    ids = torch.tensor([[1, 17, 200, 33, 4, 511, 90, 12]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)


def test_tokenizer_equals_transformers_gguf_tokenizer(tiny_gguf):
    from transformers import AutoTokenizer

    _, path = tiny_gguf
    tokenizer, config = GGUFCheckpoint.open(path).tokenizer()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert json.loads(tokenizer.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    # add_bos_token is set in the tiny file: the post-processor must prepend BOS like transformers
    for text in ("the cat sat", " leading space", "<|im_start|>user\nhi<|im_end|>", "ünïcödé ✓", ""):
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text
    assert tokenizer.encode("hi").ids[0] == 1
    assert config["add_bos_token"] is True and config["bos_token"] == "<|im_start|>"
    assert config["chat_template"] == reference.chat_template


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_pre_tokenizer_splits_equal_transformers(pre, tmp_path):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(make_tiny_model("llama", tmp_path / "hf"), tmp_path / "tiny.gguf", pre=pre)
    tokenizer, _ = GGUFCheckpoint.open(path).tokenizer()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert json.loads(tokenizer.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    text = "the 12345 cats' toys\n\n  went   away!!"
    assert tokenizer.encode(text).ids == reference(text)["input_ids"]


def test_sharded_write_has_index_and_every_tensor(tiny_gguf, tmp_path):
    from safetensors.numpy import load_file

    _, path = tiny_gguf
    checkpoint = GGUFCheckpoint.open(path)
    write_hf_dir(checkpoint, tmp_path, progress=False, shard_bytes=64 * 1024)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (tmp_path / "model.safetensors").exists()
    loaded: dict[str, np.ndarray] = {}
    for name in files:
        loaded.update(load_file(str(tmp_path / name)))
    expected = dict(checkpoint.iter_state_dict())
    assert set(loaded) == set(expected) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    for name, value in expected.items():
        np.testing.assert_array_equal(loaded[name], value)


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, head_dim, cols in ((4, 16, 64), (3, 64, 8), (1, 2, 1)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, heads), heads), w)
    bias = rng.standard_normal(4 * 16).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(bias, 4), 4), bias)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_plan_shards():
    assert plan_shards({}, 10) == []
    assert plan_shards({"a": 4, "b": 4, "c": 4}, 8) == [["a", "b"], ["c"]]
    assert plan_shards({"a": 20, "b": 1}, 8) == [["a"], ["b"]]  # an oversized tensor gets its own shard


def test_bytes_to_unicode_is_gpt2_table():
    table = bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ"


def test_unsupported_files_are_rejected_clearly(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="falcon"):
        GGUFCheckpoint.open(path)


def test_rope_freqs_is_rejected_not_ignored(tmp_path):
    import gguf

    hf_dir = make_tiny_model("llama", tmp_path / "hf")
    plain = write_tiny_gguf(hf_dir, tmp_path / "plain.gguf")
    reader = gguf.GGUFReader(plain)
    checkpoint = GGUFCheckpoint.open(plain)
    with_freqs = GGUFCheckpoint(
        plain, checkpoint.metadata, (*checkpoint.tensor_names, "rope_freqs.weight"), reader
    )
    with pytest.raises(ValueError, match="rope_freqs"):
        with_freqs.hf_config()
