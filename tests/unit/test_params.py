"""SamplingParams: vLLM defaults, normalisation, and a ValueError naming the field for every bad value."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.params import SamplingParams, validate_params_for_model, validate_prompt_token_ids


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, -1, None)
    assert (p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos) == ((), (), 0, False)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (
        0.0,
        0.0,
        1.0,
        (),
    )
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_penalties_and_bias_leave_the_argmax_fast_path():
    assert SamplingParams(temperature=0).argmax_only and not SamplingParams(temperature=0).adjusts_logits
    for kw in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: -1.0}},
    ):
        p = SamplingParams(temperature=0, **kw)
        assert p.adjusts_logits and not p.argmax_only, kw
    neutral = SamplingParams(temperature=0, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1)
    assert neutral.argmax_only and SamplingParams(temperature=0, logit_bias={}).argmax_only


def test_logit_bias_is_stored_as_sorted_pairs():
    p = SamplingParams(logit_bias={9: 1, 2: -100.0})
    assert p.logit_bias == ((2, -100.0), (9, 1.0))
    assert SamplingParams(logit_bias=[(9, 1), (2, -100)]) == p and hash(p) == hash(
        SamplingParams(logit_bias=p.logit_bias)
    )
    assert SamplingParams(logit_bias=None).logit_bias == ()


def test_lists_become_tuples_and_a_bare_stop_string_is_one_string():
    p = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"seed": 1.5}, "seed"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens (16)
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_edge_values_are_valid():
    SamplingParams(max_tokens=1, temperature=0, top_p=1.0, top_k=1, min_tokens=1, seed=-3)
    SamplingParams(top_p=1e-9, top_k=-1, temperature=100.0, seed=2**80)
    SamplingParams(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(logit_bias={i: (-100, 100)[i % 2] for i in range(300)})


def test_prompt_validation_names_the_problem():
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_token_ids([], vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match="context is 8"):
        validate_prompt_token_ids(list(range(8)), vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_prompt_token_ids([1, 10], vocab_size=10, max_model_len=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        validate_prompt_token_ids([-1], vocab_size=10, max_model_len=8)
    validate_prompt_token_ids(list(range(7)), vocab_size=10, max_model_len=8)
    for bad in (True, 2.0, "3", None):  # not ints (bool is an int, and refused), whatever their values
        with pytest.raises(ValueError, match=f"token id {bad!r} outside"):
            validate_prompt_token_ids([1, bad, 99], vocab_size=10, max_model_len=8)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token id 10 outside"):  # the first bad id is named
        validate_prompt_token_ids([1, 10, -1], vocab_size=10, max_model_len=8)


def test_params_against_the_model():
    with pytest.raises(ValueError, match="stop_token_ids"):
        validate_params_for_model(SamplingParams(stop_token_ids=[99]), vocab_size=10, can_detokenize=True)
    with pytest.raises(ValueError, match="tokenizer"):
        validate_params_for_model(SamplingParams(stop=["x"]), vocab_size=10, can_detokenize=False)
    validate_params_for_model(
        SamplingParams(stop=["x"], stop_token_ids=[9]), vocab_size=10, can_detokenize=True
    )
    with pytest.raises(ValueError, match="logit_bias has token id 10 outside"):
        validate_params_for_model(
            SamplingParams(logit_bias={10: 1, 3: 1}), vocab_size=10, can_detokenize=True
        )
    validate_params_for_model(SamplingParams(logit_bias={9: 1}), vocab_size=10, can_detokenize=True)
