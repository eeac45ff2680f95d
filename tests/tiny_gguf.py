"""Write a tiny GGUF from a tiny HF model directory, the way llama.cpp's converter lays it out.

Independent of engine/gguf_loader.py on purpose (its own name table and permutation), so the
loader is checked against llama.cpp's layout and transformers' reading of it, not against itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: interleave each head's two rotary halves.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Three control tokens, the 256 byte-level characters, then merges of letter pairs up to vocab_size."""
    from pdserve.engine.gguf_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [3, 3, 3]
    byte_chars = list(bytes_to_unicode().values())
    tokens += byte_chars
    types += [1] * len(byte_chars)
    merges: list[str] = []
    letters = "etaoinshrdlucmfwypvbgk"
    firsts = ["Ġ", *letters]
    for a in firsts:
        for b in letters:
            if len(tokens) >= vocab_size:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
            types.append(1)
    return tokens, types, merges


def write_tiny_gguf(hf_dir: Path, out: Path, *, add_bos: bool = True, pre: str = "default") -> Path:
    """A GGUF with a mix of Q4_1, Q8_0, F16 and F32 tensors and a byte-level BPE tokenizer."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("rope_parameters", {}).get("rope_type", "default") != "default":
        raise ValueError("tiny GGUFs support default rope only")
    arch = "qwen2" if config["model_type"] == "qwen2" else "llama"
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["hidden_size"] // n_head)
    writer.add_vocab_size(config["vocab_size"])
    tokens, types, merges = _tiny_vocab(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML_TEMPLATE)

    qtypes = [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, None]
    for index, (name, w) in enumerate(sorted(load_file(str(hf_dir / "model.safetensors")).items())):
        w = w.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, n_kv)
        if w.ndim == 1:
            writer.add_tensor(_gguf_name(name), w)
            continue
        qtype = qtypes[index % len(qtypes)]
        if qtype is None:
            writer.add_tensor(_gguf_name(name), w.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
