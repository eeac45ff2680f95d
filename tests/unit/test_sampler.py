"""Sampler: greedy, temperature, top-k/top-p, min_tokens, and stateless per-token seeding."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.params import SamplingParams
from pdserve.engine.sampler import (
    Sampler,
    SampleRow,
    apply_top_k_top_p,
    counter_uniform,
    counter_uniform_reference,
    inverse_cdf_sample,
    token_seed,
)

V = 64
EOS = 5


def rand_logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3  # [n, V]


def rows(params, idx=0):
    return [SampleRow(p, idx) for p in params]


def test_all_greedy_is_argmax_and_draws_no_randomness():
    s = Sampler([EOS])
    logits = rand_logits(6)
    state = s.generator.get_state().clone()
    out = s(logits, rows([SamplingParams(temperature=0)] * 6))
    assert out == logits.argmax(-1).tolist()
    assert torch.equal(s.generator.get_state(), state)


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    s = Sampler()
    logits = rand_logits(4)
    ps = [
        SamplingParams(temperature=0),
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(seed=3),
    ]
    out = s(logits, rows(ps))
    assert out[0] == logits[0].argmax().item() and out[2] == logits[2].argmax().item()


def test_caller_logits_are_not_modified():
    s = Sampler([EOS])
    logits = rand_logits(2)
    copy = logits.clone()
    s(logits, rows([SamplingParams(top_k=3, top_p=0.5, temperature=0.7, min_tokens=2, max_tokens=4)] * 2))
    assert torch.equal(logits, copy)


def test_top_k_one_and_tiny_temperature_are_greedy():
    s = Sampler()
    logits = rand_logits(8, seed=1)
    assert s(logits, rows([SamplingParams(top_k=1)] * 8)) == logits.argmax(-1).tolist()
    assert s(logits, rows([SamplingParams(temperature=1e-3)] * 8)) == logits.argmax(-1).tolist()


def test_top_k_one_takes_the_first_of_tied_logits_as_greedy():
    # bf16 rounding of the LM head ties top logits; a draw among them would leave greedy's tokens.
    s = Sampler()
    logits = torch.full((64, 50), -5.0)
    logits[:, 7] = logits[:, 31] = 3.0
    for seed in (None, 1, 2):
        got = s(logits, rows([SamplingParams(top_k=1, temperature=1.0, seed=seed)] * 64))
        assert got == [7] * 64


def test_apply_top_k_top_p_masks_outside_the_sets():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    logits = probs.log()
    out = apply_top_k_top_p(logits, torch.tensor([4, 3, 4]), torch.tensor([0.7, 1.0, 0.01]))
    keep = torch.isfinite(out)
    assert keep.tolist() == [
        [True, True, False, False],  # top-p 0.7: the smallest set reaching 0.7
        [True, True, True, False],  # top-k 3
        [False, False, False, True],  # a tiny top-p keeps the most likely token
    ]
    assert torch.equal(out[keep], logits[keep])


def test_sampled_tokens_stay_inside_top_k_and_top_p():
    s = Sampler()
    logits = rand_logits(1, seed=2)[0]
    top4 = set(logits.topk(4).indices.tolist())
    probs = logits.softmax(-1)
    srt, order = probs.sort(descending=True)
    nucleus = set(order[: int((srt.cumsum(0) < 0.6).sum()) + 1].tolist())
    for i in range(200):
        t = s(logits[None], [SampleRow(SamplingParams(top_k=4, seed=7), i)])[0]
        assert t in top4
        t = s(logits[None], [SampleRow(SamplingParams(top_p=0.6, seed=7), i)])[0]
        assert t in nucleus


def test_seeded_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]  # [1, 3]
    s = Sampler()
    n = 3000
    counts = [0, 0, 0]
    for i in range(n):
        counts[s(logits, [SampleRow(SamplingParams(seed=11), i)])[0]] += 1
    for c, p in zip(counts, probs.tolist(), strict=True):
        assert abs(c - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_unseeded_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].expand(8, 3)  # 8 rows a step, as a decode batch
    s = Sampler(seed=3)
    counts = [0, 0, 0]
    for _ in range(400):
        for t in s(logits, rows([SamplingParams()] * 8)):
            counts[t] += 1
    n = sum(counts)
    for c, p in zip(counts, probs.tolist(), strict=True):
        assert abs(c - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_unseeded_rows_never_pick_masked_tokens():
    s = Sampler(seed=1)
    logits = rand_logits(4, seed=5)
    allowed = [set(row.topk(3).indices.tolist()) for row in logits]
    for _ in range(100):
        out = s(logits, rows([SamplingParams(top_k=3)] * 4))
        assert all(t in a for t, a in zip(out, allowed, strict=True))


def test_inverse_cdf_sample_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]])
    below_one = 1.0 - 2.0**-24  # the largest float32 uniform below 1
    assert inverse_cdf_sample(probs, torch.tensor([0.0, 0.0])).tolist() == [1, 0]
    assert inverse_cdf_sample(probs, torch.tensor([0.49, 0.5])).tolist() == [1, 2]
    assert inverse_cdf_sample(probs, torch.tensor([below_one, below_one])).tolist() == [3, 3]
    # u * total at the total (what rounding could give): the most likely token, never a masked tail token
    assert inverse_cdf_sample(probs, torch.tensor([1.0, 1.0])).tolist() == [1, 0]


def test_temperature_flattens_the_distribution():
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    s = Sampler()

    def top_share(t):
        return sum(
            s(logits, [SampleRow(SamplingParams(temperature=t, seed=1), i)])[0] == 0 for i in range(600)
        )

    assert top_share(0.5) > top_share(1.0) > top_share(4.0)


def test_seeded_draw_depends_only_on_seed_and_index():
    """Same (seed, i): same token alone, at any row of any batch, with any neighbours, in a fresh sampler."""
    logits = rand_logits(8, seed=3).div(3)  # flatter, so the draw matters
    target = SamplingParams(seed=1234, top_p=0.95)
    alone = [Sampler(seed=0)(logits[3:4], [SampleRow(target, i)])[0] for i in range(20)]
    for i in range(20):
        others = [
            SamplingParams(seed=i),
            SamplingParams(),
            SamplingParams(temperature=0),
            SamplingParams(top_k=5),
        ]
        batch_params = others[:2] + [target] + others[2:]
        batch_logits = torch.cat([logits[0:2], logits[3:4], logits[5:7]])
        sampler = Sampler(seed=99 + i)  # a different engine-wide generator changes nothing for seeded rows
        out = sampler(
            batch_logits,
            [
                SampleRow(p, 5 * i + k) if p is not target else SampleRow(p, i)
                for k, p in enumerate(batch_params)
            ],
        )
        assert out[2] == alone[i]
    assert len(set(alone)) > 3  # the index changes the draw


def test_different_seeds_give_different_streams():
    logits = torch.zeros(1, V)
    a = [Sampler()(logits, [SampleRow(SamplingParams(seed=1), i)])[0] for i in range(30)]
    b = [Sampler()(logits, [SampleRow(SamplingParams(seed=2), i)])[0] for i in range(30)]
    assert a != b


def test_unseeded_rows_follow_the_engine_generator():
    logits = torch.zeros(4, V)
    ps = rows([SamplingParams()] * 4)
    assert Sampler(seed=5)(logits, ps) == Sampler(seed=5)(logits, ps)
    draws = {tuple(Sampler(seed=k)(logits, ps)) for k in range(5)}
    assert len(draws) > 1


def test_token_seed_is_63_bit_and_distinct():
    seeds = {token_seed(s, i) for s in (0, 1, -1, 2**40) for i in range(50)}
    assert len(seeds) == 200
    assert all(0 <= x < 2**63 for x in seeds)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(temperature):
    logits = torch.full((1, V), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 20] = 1.0
    s = Sampler([EOS])
    p = SamplingParams(temperature=temperature, seed=0, min_tokens=3, max_tokens=8, stop_token_ids=[9])
    for i in range(3):
        assert s(logits, [SampleRow(p, i)])[0] not in (EOS, 9)
    assert s(logits, [SampleRow(SamplingParams(temperature=0, min_tokens=3, max_tokens=8), 3)])[0] == EOS
    if temperature == 0:
        assert s(logits, [SampleRow(p, 0)])[0] == 20
        # As in vLLM and transformers' min_new_tokens, eos stays masked with ignore_eos.
        q = SamplingParams(temperature=0, min_tokens=3, max_tokens=8, ignore_eos=True)
        assert s(logits, [SampleRow(q, 0)])[0] == 9
        assert s(logits, [SampleRow(q, 3)])[0] == EOS


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, V), rows([SamplingParams()]))
    assert Sampler()(torch.zeros(0, V), []) == []


def test_counter_noise_matches_its_pure_python_spec_and_is_uniform():
    """The seeded noise is the same bits wherever torch's int64 ops run (they wrap): checked against the
    pure-Python spec for keys near the int64 edges, and roughly uniform."""
    keys = [0, 1, 2**62 + 12345, token_seed(-1, 7), token_seed(2**40, 0)]
    u = counter_uniform(torch.tensor(keys, dtype=torch.int64), 300)
    for r, key in enumerate(keys):
        for j in (0, 1, 17, 299):
            assert u[r, j].item() == pytest.approx(counter_uniform_reference(key, j), abs=0, rel=1e-7)
    assert 0 < u.min().item() and u.max().item() < 1
    assert abs(u.mean().item() - 0.5) < 0.02
    big = counter_uniform(torch.tensor([token_seed(3, i) for i in range(64)]), 4096)
    hist = torch.histc(big, bins=10, min=0, max=1) / big.numel()
    assert (hist - 0.1).abs().max().item() < 0.01


@pytest.mark.gpu
def test_seeded_draws_are_the_same_on_cuda_as_on_cpu():
    logits = rand_logits(6, seed=9).div(3)
    ps = [SampleRow(SamplingParams(seed=s, top_k=20 if s % 2 else -1), s) for s in range(6)]
    assert Sampler(device="cuda")(logits.cuda(), ps) == Sampler()(logits, ps)


def test_top_k_top_p_masks_do_not_depend_on_the_candidate_width():
    """Rows decided within their top candidates and rows sorted whole keep the same tokens; logits rounded
    to bfloat16 put ties at the boundaries."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(24, 300, generator=g) * torch.linspace(0.2, 4.0, 24)[:, None]).bfloat16().float()
    k = torch.tensor([300, 1, 2, 7, 40, 299, 300, 150] * 3)
    p = torch.tensor([0.5, 1.0, 0.9, 0.95, 1.0, 0.3, 0.999, 0.7] * 3)
    whole = apply_top_k_top_p(logits, k, p, candidates=300)
    for c in (2, 3, 8, 64, 256):
        assert torch.equal(apply_top_k_top_p(logits, k, p, candidates=c), whole), c
    # and a row alone is masked as it is in the batch
    for i in (0, 5, 13, 22):
        alone = apply_top_k_top_p(logits[i : i + 1], k[i : i + 1], p[i : i + 1], candidates=8)
        assert torch.equal(alone[0], whole[i])


def test_top_k_top_p_keep_every_token_tied_with_the_last_member():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 2.0, 0.0, -1.0, 2.0]])
    probs = logits.softmax(-1)
    # top-p reached inside the tied run of row 0; top-k 2 cuts inside the tied run of row 1
    p0 = float(probs[0, 0] + probs[0, 1] / 2)
    for c in (2, 3, 6):
        out = apply_top_k_top_p(logits, torch.tensor([6, 2]), torch.tensor([p0, 1.0]), candidates=c)
        assert torch.isfinite(out).tolist() == [
            [True, True, True, True, False, True],
            [True, True, True, False, False, True],
        ]


def test_top_p_near_one_keeps_the_top_k_set():
    logits = rand_logits(3, seed=9)
    out = apply_top_k_top_p(
        logits, torch.tensor([V, 10, V]), torch.tensor([1.0 - 1e-9, 1.0 - 1e-9, 0.999999])
    )
    assert torch.isfinite(out[0]).all() and int(torch.isfinite(out[1]).sum()) == 10
    assert int(torch.isfinite(out[2]).sum()) >= V - 8


def test_top_k_top_p_match_a_plain_reference():
    """Per row, in float64: keep the top-k set, then each token of it whose more likely tokens' mass is
    below p."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(12, 500, generator=g) * torch.linspace(0.3, 5.0, 12)[:, None]
    k = torch.tensor([500, 20, 3, 500, 300, 1] * 2)
    p = torch.tensor([0.9, 0.8, 1.0, 0.5, 0.97, 0.9, 0.2, 1.0, 0.6, 0.99, 0.75, 0.4])
    out = apply_top_k_top_p(logits, k, p, candidates=16)
    for i in range(12):
        vals, order = logits[i].double().sort(descending=True)
        vals = vals[: int(k[i])]
        probs = vals.softmax(0)
        above = probs.cumsum(0) - probs
        kept = order[: int((above < float(p[i])).sum()) if p[i] < 1 else int(k[i])]
        assert set(torch.isfinite(out[i]).nonzero().squeeze(1).tolist()) == set(kept.tolist()), i
