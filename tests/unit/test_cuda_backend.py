"""The CUDA backend through the engine: Triton kernels, decode CUDA graphs, GPU sampling, ``--device``.

On CPU (CI) the Triton backend runs in Triton's interpreter (tests/conftest.py): the engine-level tests
here check it against the torch backend. The ``gpu`` tests run on the GPU machine
(``pytest -m gpu``) and skip cleanly elsewhere.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the CUDA backend's kernels)")

from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.block_manager import BlockManager  # noqa: E402
from pdserve.engine.cuda_backend import (  # noqa: E402
    DecodeGraphs,
    PrefillGraphs,
    decode_buckets,
    make_prefill_forward,
    prefill_buckets,
    prefill_inputs,
)
from pdserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pdserve.engine.model_runner import Backend, ModelRunner, PrefillItem  # noqa: E402
from tests.tiny_models import load_reference  # noqa: E402

CUDA = torch.cuda.is_available()
PROMPTS = [[5, 9, 33, 7], list(range(40, 77)), [100], list(range(3, 23))]


def _greedy(engine: LLMEngine, prompts, max_tokens: int, params=None) -> list[list[int]]:
    sp = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(i, p, sp)
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for d in engine.step():
            out[d.request_id].extend(d.new_token_ids)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks  # nothing stranded
    return [out[i] for i in range(len(prompts))]


def test_decode_buckets_cover_every_batch_size():
    assert decode_buckets(1) == [1]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    b = decode_buckets(256)
    assert b[-1] == 256 and b == sorted(set(b)) and 80 in b and 240 in b
    assert decode_buckets(300)[-2:] == [288, 300]


def _staging(max_batch: int = 8) -> tuple[DecodeGraphs, list[dict[str, torch.Tensor]]]:
    """Decode graphs (eager, on CPU) whose forward records the inputs each step staged."""
    seen: list[dict[str, torch.Tensor]] = []

    def forward(ids, positions, slots, tables, lens, splits):  # type: ignore[no-untyped-def]
        seen.append(
            {"ids": ids.clone(), "pos": positions.clone(), "slots": slots.clone(), "tables": tables.clone(),
             "lens": lens.clone()}
        )  # fmt: skip
        return torch.zeros(len(ids), 3)

    graphs = DecodeGraphs(
        forward, max_batch=max_batch, max_blocks=8, block_size=4, num_blocks=64, num_kv_heads=2, max_len=32,
        device=torch.device("cpu"), use_graphs=False,
    )  # fmt: skip
    return graphs, seen


def test_decode_staging_follows_tables_that_grow_move_rows_and_are_replaced():
    """The engine passes the block manager's own tables (``live_tables``): a row is rewritten only when
    its list changed. Over random steps (sequences arriving, finishing, preempted and allocated again
    under the same id, rows reordered, tables growing across blocks), every staged input equals what
    the tables say, and equals a run that writes every row in full."""
    import random

    rng = random.Random(0)
    live, seen_live = _staging()
    full, seen_full = _staging()
    bm = BlockManager(64, 4)
    length: dict[int, int] = {}  # tokens cached + the one decoded this step
    next_id = 0
    for step in range(300):
        if len(length) < 8 and rng.random() < 0.3:
            length[next_id] = rng.randint(1, 12)
            bm.allocate(next_id, length[next_id])
            next_id += 1
        if length and rng.random() < 0.15:  # finishes
            gone = rng.choice(list(length))
            bm.free(gone)
            del length[gone]
        if length and rng.random() < 0.1:  # preempted and back: the same id, a new list
            sid = rng.choice(list(length))
            bm.free(sid)
            bm.allocate(sid, length[sid])
        ids = sorted(length)
        if rng.random() < 0.2:
            rng.shuffle(ids)
        if not ids:
            continue
        for sid in ids:
            length[sid] = min(length[sid] + 1, 31)
            bm.grow(sid, length[sid])
        tokens = [rng.randrange(1000) for _ in ids]
        positions = [length[s] - 1 for s in ids]
        live.run_columns(tokens, positions, bm.live_tables(ids))
        full.run_columns(tokens, positions, bm.block_tables(ids), live_tables=False)
        got, want = seen_live[-1], seen_full[-1]
        n = len(ids)
        for key in ("ids", "pos", "slots", "lens"):
            assert torch.equal(got[key], want[key]), (step, key)
        assert got["ids"][:n].tolist() == tokens
        assert got["lens"][:n].tolist() == [p + 1 for p in positions]
        for i, (sid, pos) in enumerate(zip(ids, positions, strict=True)):
            table = bm.block_table(sid)
            used = pos // 4 + 1
            assert got["tables"][i, :used].tolist() == table[:used], (step, i)
            assert got["slots"][i] == table[pos // 4] * 4 + pos % 4
        assert (got["slots"][n:] == -1).all() and (got["lens"][n:] == 0).all()  # padding writes nothing
    assert next_id > 10 and len(seen_live) > 250


def test_decode_staging_refuses_bad_tables_and_positions_then_recovers():
    graphs, seen = _staging()
    table = [3, 4]
    with pytest.raises(ValueError, match="block table of 2 blocks cannot hold 9 tokens"):
        graphs.run_columns([1], [8], [table])
    table.append(5)  # the same list, long enough now: the row is written again, not trusted
    graphs.run_columns([1], [8], [table])
    assert seen[-1]["tables"][0, :3].tolist() == [3, 4, 5] and seen[-1]["slots"][0] == 20
    with pytest.raises(ValueError, match=r"ids outside \[0, 64\)"):
        graphs.run_columns([1], [8], [[3, 4, 64]])
    with pytest.raises(ValueError, match="position must be >= 0"):
        graphs.run_columns([1], [-1], [table])
    with pytest.raises(ValueError, match="position 32 exceeds the model context of 32"):
        graphs.run_columns([1], [32], [[0] * 9])
    graphs.run_columns([7], [9], [table])
    assert seen[-1]["ids"][0] == 7 and seen[-1]["slots"][0] == 21
    # A step refused after it wrote a row: the next step must not trust that row (or the device copy).
    other = [6, 7, 8]
    with pytest.raises(ValueError, match="ids outside"):
        graphs.run_columns([1, 1], [8, 8], [other, [9, 10, 64]])
    graphs.run_columns([1], [8], [other])
    assert seen[-1]["tables"][0, :3].tolist() == [6, 7, 8] and seen[-1]["slots"][0] == 32


def test_prefill_inputs_index_the_cache_like_the_torch_path():
    items = [([7, 8, 9], [4, 2], 14), ([1], [0], 0)]
    inp = prefill_inputs(items, 16, 8, torch.device("cpu"))
    assert inp.token_ids.tolist() == [7, 8, 9, 1]
    assert inp.positions.tolist() == [14, 15, 16, 0]
    assert inp.slots.tolist() == [4 * 16 + 14, 4 * 16 + 15, 2 * 16 + 0, 0]
    assert inp.cu_seqlens.tolist() == [0, 3, 4] and inp.start_pos.tolist() == [14, 0]
    assert inp.last_rows.tolist() == [2, 3] and inp.max_new == 3
    assert inp.tables.tolist() == [[4, 2], [0, 0]]
    with pytest.raises(ValueError, match="cannot hold"):
        prefill_inputs([([1, 2], [3], 15)], 16, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside"):
        prefill_inputs([([1, 2], [9], 0)], 16, 8, torch.device("cpu"))


def test_prefill_buckets_pad_by_less_than_half():
    assert prefill_buckets(16) == [16]
    b = prefill_buckets(2048)
    assert b[:8] == [16, 32, 64, 128, 192, 256, 384, 512] and b[-3:] == [1024, 1536, 2048]
    assert all(later < 2 * earlier for earlier, later in zip(b[3:], b[4:], strict=False))
    assert prefill_buckets(1000)[-2:] == [768, 1000]


@pytest.mark.slow  # Triton's interpreter: `make test` runs it, `make test-fast` skips it
@pytest.mark.skipif(CUDA, reason="the interpreter path; on a GPU the gpu test below covers it")
def test_interpreted_prefill_graph_inputs_give_the_eager_prefill(tiny_llama_dir):
    """The graph path's static buffers run eagerly (no graphs off CUDA): padded to a bucket, a chunk
    gives the eager prefill's logits and cache, a chunk after a cached prefix too, and padding rows store
    nothing."""
    runner = ModelRunner(tiny_llama_dir, backend="triton", block_size=4, num_blocks=40)
    c = runner.config
    graphs = PrefillGraphs(
        make_prefill_forward(runner.weights, c, runner.rope, runner.kv),
        max_tokens=64, max_blocks=c.max_position_embeddings // 4, block_size=4, num_blocks=40,
        device=torch.device("cpu"), use_graphs=False,
    )  # fmt: skip
    prompt, table = list(range(7, 30)), [9, 3, 17, 5, 22, 11, 30]  # 23 tokens: bucket 32, 9 padding rows
    with torch.inference_mode():
        runner.kv.zero_()
        want = runner.prefill([PrefillItem(prompt, table)])
        want_kv = runner.kv.clone()
        runner.kv.zero_()
        got = graphs.run(prompt, table, 0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(runner.kv, want_kv, atol=1e-6, rtol=1e-6)  # nothing else written
        # The last 5 tokens again after the first 18 cached: the chunk attends over the prefix.
        got = graphs.run(prompt[18:], table, 18)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot hold"):
        graphs.run(prompt, table[:2], 0)
    assert not graphs.fits(65, 0) and graphs.fits(64, 0)


@pytest.mark.slow  # Triton's interpreter: `make test` runs it, `make test-fast` skips it
@pytest.mark.skipif(CUDA, reason="the interpreter path; on a GPU the gpu tests below cover it")
def test_interpreted_triton_engine_matches_the_torch_engine(tiny_llama_dir):
    """Whole engine (scheduler, chunked prefill, decode, sampler) on the Triton backend equals the torch
    backend: greedy tokens, and seeded sampled tokens."""
    cfg = EngineConfig(dtype="float32", max_num_batched_tokens=32, max_num_seqs=8)

    def engine(backend: str) -> LLMEngine:
        return LLMEngine(ModelRunner(tiny_llama_dir, backend=backend, block_size=4, num_blocks=96), None, cfg)

    tri = engine("triton")
    assert tri.runner.backend is Backend.TRITON
    ref = engine("torch")
    assert _greedy(tri, PROMPTS, 6) == _greedy(ref, PROMPTS, 6)  # 37 tokens > 32: chunked prefill too
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=5, ignore_eos=True)
    assert _greedy(tri, PROMPTS[:2], 5, seeded) == _greedy(ref, PROMPTS[:2], 5, seeded)


def _count_fused_gemv(monkeypatch) -> dict[str, int]:
    """Counts of ``triton_kernels.gemv`` calls taking a norm (``norm``) or adding into the residual stream
    (``add_to``), as the CUDA backend makes them."""
    from pdserve.engine import triton_kernels as tk

    calls = {"norm": 0, "add_to": 0, "plain": 0}
    gemv = tk.gemv

    def counted(*args, **kwargs):
        kinds = [k for k in ("norm", "add_to") if kwargs.get(k) is not None] or ["plain"]
        for k in kinds:
            calls[k] += 1
        return gemv(*args, **kwargs)

    monkeypatch.setattr(tk, "gemv", counted)
    return calls


@pytest.mark.slow  # Triton's interpreter: `make test` runs it, `make test-fast` skips it
@pytest.mark.skipif(CUDA, reason="the interpreter path; on a GPU the gpu test below covers it")
@pytest.mark.parametrize(
    ("kind", "fuse"), [("llama", True), ("qwen2", True), ("llama", False)],
    ids=["llama-fused-norms", "qwen2-fused-norms", "llama-separate-norms"],
)  # fmt: skip
def test_interpreted_batch_one_products_match_transformers(kind, fuse, tmp_path, monkeypatch):
    """Decode at batch 1 runs its products as ``gemv`` (plain weights, as on a GPU), the norms and
    residual adds taken into them (``triton_kernels.FUSE_NORMS``) or not: transformers' greedy tokens
    either way, qwen2's biases included."""
    from pdserve.engine import triton_kernels as tk
    from tests.tiny_models import make_tiny_model

    monkeypatch.setenv("PDSERVE_LINEAR", "plain")  # the CPU would pack its weights for its C kernels
    monkeypatch.setattr(tk, "FUSE_NORMS", fuse)
    calls = _count_fused_gemv(monkeypatch)
    d = make_tiny_model(kind, tmp_path / kind)
    runner = ModelRunner(d, backend="triton", block_size=16, num_blocks=64)
    engine = LLMEngine(runner, None, EngineConfig(dtype="float32", max_num_seqs=1))
    prompt = PROMPTS[1]
    assert _greedy(engine, [prompt], 6) == _hf_greedy(d, [prompt], 6)
    layers = runner.config.num_layers
    steps = 5  # decode steps (token 0 comes from the prefill)
    if fuse:  # qkv and gate_up normalise, o and down add: two of each a layer and step
        assert calls["norm"] == calls["add_to"] == 2 * layers * steps
    else:
        assert calls["norm"] == calls["add_to"] == 0 and calls["plain"] >= 4 * layers * steps


def test_triton_backend_is_refused_where_it_cannot_run(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if CUDA:
        pytest.skip("a CUDA device is here")
    with pytest.raises(ValueError, match="backend='triton' is unavailable"):
        ModelRunner(tiny_llama_dir, backend="triton", num_blocks=8)


# -- on the GPU machine -------------------------------------------------------------------------------


def _hf_greedy(model_dir, prompts, n: int) -> list[list[int]]:
    ref = load_reference(model_dir)
    ref.generation_config.eos_token_id = None
    out = []
    for p in prompts:
        with torch.inference_mode():
            g = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gpu_float32_greedy_matches_transformers_for_64_steps(kind, tmp_path):
    from tests.tiny_models import make_tiny_model

    d = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(d, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8)
    assert llm.engine.runner.backend is Backend.TRITON and llm.engine.runner.graph_capture_s is not None
    got = _greedy(llm.engine, PROMPTS, 64)
    assert got == _hf_greedy(d, PROMPTS, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True], ids=["separate-norms", "fused-norms"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_gpu_float32_greedy_at_batch_one_matches_transformers_for_64_steps(kind, fuse, tmp_path, monkeypatch):
    """One request at a time: decode's batch-1 graph, whose products run as ``gemv`` (where they win:
    ``triton_kernels.gemv_wins``), the norms and residual adds fused into them or not
    (``triton_kernels.FUSE_NORMS``, read when the graphs are captured)."""
    from pdserve.engine import triton_kernels as tk
    from tests.tiny_models import make_tiny_model

    monkeypatch.setattr(tk, "FUSE_NORMS", fuse)

    d = make_tiny_model(kind, tmp_path / kind)
    llm = LLM(d, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8)
    got = [_greedy(llm.engine, [p], 64)[0] for p in PROMPTS]
    assert got == _hf_greedy(d, PROMPTS, 64)


@pytest.mark.gpu
def test_gpu_graph_path_gives_the_eager_path_tokens(tiny_llama_dir):
    graphs = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8)
    eager = LLM(
        tiny_llama_dir, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8, enforce_eager=True
    )
    assert eager.engine.runner.graph_capture_s is None
    assert _greedy(graphs.engine, PROMPTS, 40) == _greedy(eager.engine, PROMPTS, 40)


@pytest.mark.gpu
def test_gpu_prefill_graph_gives_the_eager_prefill_and_calls_every_layer_hook(tiny_llama_dir):
    runner = ModelRunner(tiny_llama_dir, dtype=torch.float32, device="cuda", num_blocks=64)
    eager_logits = []
    for prompt, start in ((list(range(3, 103)), 0), (list(range(3, 103)), 60)):
        table = list(range(-(-len(prompt) // runner.block_size)))
        if start:  # a cached prefix: its K/V are in the cache from the full prompt's prefill above
            prompt = prompt[start:]
        eager_logits.append(runner.prefill([PrefillItem(prompt, table, start)]))
    runner.prepare_prefill(128)
    assert runner.graph_capture_s is not None
    seen: list[tuple[int, object, object]] = []
    for (prompt, start), want in zip(
        ((list(range(3, 103)), 0), (list(range(63, 103)), 60)), eager_logits, strict=True
    ):
        table = list(range(-(-(start + len(prompt)) // runner.block_size)))
        got = runner.prefill(
            [PrefillItem(prompt, table, start)], layer_hook=lambda i, k, v: seen.append((i, k, v))
        )
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert int(got.argmax()) == int(want.argmax())
    assert seen == [(i, None, None) for i in range(runner.config.num_layers)] * 2

    class Many:  # a hook that takes every layer in one call (the prefill loop's, for push_layers)
        def __init__(self) -> None:
            self.calls: list[object] = []

        def __call__(self, i, k, v):  # type: ignore[no-untyped-def]
            self.calls.append(i)

        def layers_written(self, count: int) -> None:
            self.calls.append(("all", count))

    many = Many()
    runner.prefill([PrefillItem(list(range(3, 103)), list(range(25)))], layer_hook=many)
    assert many.calls == [("all", runner.config.num_layers)]
    # Past the largest bucket: eager, hooks with the layer's K/V.
    long = list(range(3, 203))
    seen.clear()
    runner.prefill([PrefillItem(long, list(range(13)))], layer_hook=lambda i, k, v: seen.append((i, k, v)))
    assert all(k is not None and k.shape[0] == 200 for _, k, _ in seen)


# Prompts whose contexts cross 64, 128 and 256 tokens within 24 decode steps: the split count of the
# decode attention (decode_splits: one split per tile of 64 keys) goes 1 -> 2, 2 -> 4 and 4 -> 8.
SPLIT_PROMPTS = [list(range(3, 53)), [7] + list(range(200, 309)), list(range(10, 250))]


@pytest.mark.slow  # Triton's interpreter: `make test` runs it, `make test-fast` skips it
@pytest.mark.skipif(CUDA, reason="the interpreter path; on a GPU the gpu test below covers it")
def test_interpreted_decode_across_split_counts_matches_transformers(tiny_llama_dir):
    from pdserve.engine.triton_kernels import decode_splits

    assert [decode_splits(1, 2, n, 8) for n in (64, 65, 129, 257)] == [1, 2, 4, 8]
    runner = ModelRunner(tiny_llama_dir, backend="triton", block_size=16, num_blocks=64)
    engine = LLMEngine(runner, None, EngineConfig(dtype="float32", max_num_seqs=4))
    # Contexts 60 -> 68 and 124 -> 132 in 8 steps: 1 -> 2 and 2 -> 4 splits (the interpreter pays ~40 ms
    # a launch, ~25 launches a step; the GPU test runs SPLIT_PROMPTS' 24 steps).
    prompts = [list(range(3, 63)), [7] + list(range(200, 323))]
    assert [_greedy(engine, [p], 8)[0] for p in prompts] == _hf_greedy(tiny_llama_dir, prompts, 8)


@pytest.mark.gpu
def test_gpu_graphs_of_every_split_count_give_the_transformers_tokens(tiny_llama_dir):
    """Each sequence alone (bucket 1) crosses a split count while decoding, then all together (bucket 4):
    every graph replayed gives the tokens of transformers."""
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_blocks=512, max_num_seqs=4)
    graphs = llm.engine.runner._decoder.graphs
    assert {(1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (4, 2), (4, 4), (4, 8)} <= set(graphs)
    want = _hf_greedy(tiny_llama_dir, SPLIT_PROMPTS, 24)
    assert [_greedy(llm.engine, [p], 24)[0] for p in SPLIT_PROMPTS] == want
    assert _greedy(llm.engine, SPLIT_PROMPTS, 24) == want


@pytest.mark.gpu
def test_gpu_seeded_requests_sample_the_same_alone_and_in_a_batch(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8)
    sp = SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=24, ignore_eos=True)
    alone = _greedy(llm.engine, PROMPTS[1:2], 24, sp)[0]
    batch = _greedy(llm.engine, PROMPTS, 24, sp)
    assert batch[1] == alone


@pytest.mark.gpu
def test_gpu_bad_input_and_a_cache_too_big_fail_clearly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, dtype="float32", device="cuda", num_blocks=64)
    with pytest.raises(ValueError, match="outside the vocabulary|vocab"):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    free, _ = torch.cuda.mem_get_info()
    per_block = llm.engine.runner.kv_bytes_per_token * 16
    with pytest.raises(ValueError, match="--num-blocks"):
        ModelRunner(tiny_llama_dir, device="cuda", num_blocks=2 * free // per_block)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        ModelRunner(tiny_llama_dir, device="cuda", gpu_memory_utilization=1e-6)
