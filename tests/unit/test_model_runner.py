"""ModelRunner behaviour beyond parity: paging, chunked prefill, batching, the layer hook, sizing, errors."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.config import ModelConfig, RopeScaling
from pdserve.engine.cpu_kernels import kernel_cache_dir, load_cpu_kernels
from pdserve.engine.model_runner import DecodeItem, ModelRunner, PrefillItem
from pdserve.engine.weights import load_state_dict
from tests.tiny_models import load_reference


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["torch", "cpu_kernels"])
def runner(tiny_llama_dir, request):
    if request.param == "cpu_kernels" and load_cpu_kernels(kernel_cache_dir()) is None:
        pytest.skip("no C compiler here: the engine runs its torch path")
    return ModelRunner(tiny_llama_dir, block_size=4, num_blocks=128, backend=request.param)


def test_cache_layout_and_sizing(tiny_llama_dir, runner):
    c = runner.config
    assert runner.kv.shape == (c.num_layers, 128, 2, 4, c.num_kv_heads, c.head_dim)
    assert runner.kv.is_contiguous() and runner.kv.dtype == torch.float32
    assert runner.kv_bytes_per_token == c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    by_bytes = ModelRunner(
        tiny_llama_dir, block_size=16, kv_cache_bytes=runner.kv_bytes_per_token * 16 * 10 + 5
    )
    assert by_bytes.num_blocks == 10
    default = ModelRunner(tiny_llama_dir, dtype=torch.bfloat16)
    assert default.block_size == 16
    assert default.num_blocks * 16 == c.max_position_embeddings * 8
    assert default.kv_bytes_per_token == runner.kv_bytes_per_token // 2


def test_scattered_tables_equal_contiguous(runner):
    prompts = [_ids(n, s) for s, n in enumerate((13, 5, 21))]
    contiguous = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    # Disjoint from the contiguous blocks 0-23, out of order, interleaved between sequences.
    scattered = [
        [120, 31, 77, 41, 29, 100, 64, 30],
        [55, 112, 90, 24, 111, 70, 33, 118],
        [28, 99, 25, 47, 126, 60, 57, 81],
    ]
    a = runner.prefill([PrefillItem(p, t) for p, t in zip(prompts, contiguous, strict=True)], all_logits=True)
    b = runner.prefill([PrefillItem(p, t) for p, t in zip(prompts, scattered, strict=True)], all_logits=True)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for step in range(6):  # crosses block boundaries (block_size 4)
        tok = 7 + step
        da = runner.decode(
            [DecodeItem(tok, len(p) + step, t) for p, t in zip(prompts, contiguous, strict=True)]
        )
        db = runner.decode(
            [DecodeItem(tok, len(p) + step, t) for p, t in zip(prompts, scattered, strict=True)]
        )
        torch.testing.assert_close(da, db, rtol=0, atol=1e-5)


@pytest.mark.parametrize("split", [1, 4, 9, 16])
def test_chunked_prefill_equals_one_prefill(runner, split):
    prompt, other = _ids(17, 1), _ids(6, 2)
    table, other_table = [5, 90, 17, 3, 44], [60, 61]
    whole = runner.prefill([PrefillItem(prompt, table), PrefillItem(other, other_table)], all_logits=True)
    runner.kv.zero_()
    first = runner.prefill([PrefillItem(prompt[:split], table)], all_logits=True)
    # The second chunk is batched with an unrelated fresh prompt.
    rest = runner.prefill(
        [PrefillItem(prompt[split:], table, start_pos=split), PrefillItem(other, other_table)],
        all_logits=True,
    )
    torch.testing.assert_close(
        torch.cat([first, rest[: len(prompt) - split]]), whole[: len(prompt)], rtol=0, atol=1e-4
    )
    torch.testing.assert_close(rest[len(prompt) - split :], whole[len(prompt) :], rtol=0, atol=1e-4)
    # Decoding after the chunked prefill continues exactly as after a single prefill.
    nxt = int(whole[len(prompt) - 1].argmax())
    out = runner.decode([DecodeItem(nxt, len(prompt), table)])
    ref = load_reference(runner.model_dir)
    with torch.inference_mode():
        want = ref(torch.tensor([prompt + [nxt]])).logits[0, -1]
    torch.testing.assert_close(out[0], want, rtol=0, atol=1e-4)


def test_decode_batch_invariance(runner):
    """A sequence decoded alone or among others of different lengths gets the same logits."""
    prompts = [_ids(n, 10 + n) for n in (3, 29, 11, 1)]
    tables = [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    runner.prefill([PrefillItem(p, t) for p, t in zip(prompts, tables, strict=True)])
    batch = runner.decode([DecodeItem(5, len(p), t) for p, t in zip(prompts, tables, strict=True)])
    for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
        alone = runner.decode([DecodeItem(5, len(p), t)])
        torch.testing.assert_close(alone[0], batch[i], rtol=0, atol=1e-5)


def test_mixed_step_equals_separate_prefill_and_decode(runner):
    """Decodes and prefill chunks (fresh and continuing a cached prefix) in one forward give the logits
    and cache contents that separate decode and prefill calls give."""
    running = [_ids(n, 20 + n) for n in (7, 12)]
    run_tables = [[3, 50, 9], [70, 71, 72, 73]]
    fresh, cont = _ids(10, 31), _ids(9, 32)
    fresh_table, cont_table = [100, 101, 102], [110, 111, 112]
    runner.kv.zero_()
    runner.prefill([PrefillItem(p, t) for p, t in zip(running, run_tables, strict=True)])
    runner.prefill([PrefillItem(cont[:5], cont_table)])
    decodes = [
        DecodeItem(11 + i, len(p), t) for i, (p, t) in enumerate(zip(running, run_tables, strict=True))
    ]
    prefills = [PrefillItem(fresh, fresh_table), PrefillItem(cont[5:], cont_table, start_pos=5)]
    saved = runner.kv.clone()
    want = torch.cat([runner.decode(decodes), runner.prefill(prefills)])
    want_kv = runner.kv.clone()
    runner.kv.copy_(saved)
    got = runner.step(prefills, decodes)
    assert got.shape == (4, runner.config.vocab_size)
    # Rows of a product are computed in tiles whose size depends on the batch: rounding, not a bug.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(runner.kv, want_kv, rtol=0, atol=1e-5)
    assert torch.equal(runner.step([], decodes), runner.decode(decodes))


def test_layer_hook_gets_cached_kv(runner):
    c = runner.config
    prompts = [_ids(6, 3), _ids(9, 4)]
    tables = [[40, 2], [7, 77, 13]]
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    with_hook = runner.prefill(
        [PrefillItem(p, t) for p, t in zip(prompts, tables, strict=True)],
        layer_hook=lambda layer, k, v: seen.append((layer, k.clone(), v.clone())),
    )
    assert [s[0] for s in seen] == list(range(c.num_layers))
    b = runner.block_size
    for layer, k, v in seen:
        assert k.shape == v.shape == (15, c.num_kv_heads, c.head_dim)
        row = 0
        for p, t in zip(prompts, tables, strict=True):
            for pos in range(len(p)):
                blk, off = t[pos // b], pos % b
                assert torch.equal(runner.kv[layer, blk, 0, off], k[row])
                assert torch.equal(runner.kv[layer, blk, 1, off], v[row])
                row += 1
    without = runner.prefill([PrefillItem(p, t) for p, t in zip(prompts, tables, strict=True)])
    assert torch.equal(with_hook, without)


def test_bad_inputs_raise(runner):
    with pytest.raises(ValueError, match="at least one"):
        runner.prefill([])
    with pytest.raises(ValueError, match="no tokens"):
        runner.prefill([PrefillItem([], [0])])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.prefill([PrefillItem(_ids(9, 0), [0, 1])])
    with pytest.raises(ValueError, match="outside"):
        runner.prefill([PrefillItem(_ids(3, 0), [128])])
    with pytest.raises(ValueError, match="context"):
        runner.decode([DecodeItem(3, runner.config.max_position_embeddings, list(range(128)))])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.decode([DecodeItem(3, 4, [0])])
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(runner.model_dir, dtype=torch.int8)


def test_config_spellings_and_errors():
    base = dict(
        model_type="llama",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    old = ModelConfig.from_hf(
        {
            **base,
            "rope_theta": 5e5,
            "eos_token_id": [2, 3],
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        {"eos_token_id": [3, 7]},
    )
    new = ModelConfig.from_hf(
        {
            **base,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        }
    )
    assert old.rope_scaling == new.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert old.rope_theta == new.rope_theta == 5e5 and old.head_dim == 4
    assert old.eos_token_ids == (2, 3, 7) and new.eos_token_ids == (2,)
    assert ModelConfig.from_hf({**base, "model_type": "qwen2"}).attention_bias
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf({**base, "model_type": "mistral", "sliding_window": 16})


def test_sharded_checkpoint_loads_like_single(tiny_llama_dir, tmp_path, runner):
    ref = load_reference(tiny_llama_dir)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    single = load_state_dict(tiny_llama_dir, torch.float32)
    sharded = load_state_dict(tmp_path, torch.float32)
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    items = [PrefillItem(_ids(5, 9), [0, 1])]
    torch.testing.assert_close(
        ModelRunner(tmp_path, block_size=4, num_blocks=8, backend=runner.backend).prefill(items),
        runner.prefill(items),
        rtol=0,
        atol=0,
    )
