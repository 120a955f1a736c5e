"""A new drafting method is one file plus one registry line (docs/new-proposer.md): registered that way, the toy
proposer of toy_proposer.py gets its option routed, validated and offered as a flag, and it runs losslessly."""

from __future__ import annotations

import pytest

from eyas import LLM, SamplingParams
from eyas.cli import _spec_config, build_parser
from eyas.spec_decode import registry
from eyas.spec_decode.config import SpeculativeConfig


@pytest.fixture
def repeat_registered(monkeypatch):
    monkeypatch.setitem(registry.PROPOSERS, "repeat", ("toy_proposer", "RepeatProposer"))  # the one line


def test_its_option_is_routed_and_validated(repeat_registered):
    spec = SpeculativeConfig.from_dict({"method": "repeat", "num_speculative_tokens": 4, "repeat_max_drafts": 3})
    assert spec.options.repeat_max_drafts == 3
    with pytest.raises(ValueError, match="repeat_max_drafts: 0 must be >= 1"):
        SpeculativeConfig.from_dict({"method": "repeat", "num_speculative_tokens": 4, "repeat_max_drafts": 0})
    with pytest.raises(ValueError, match="repeat_max_drafts: not used by method 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "repeat_max_drafts": 3})


def test_the_command_line_offers_its_name_and_flag(repeat_registered):
    args = build_parser().parse_args(["generate", "hi", "--spec-method", "repeat", "--repeat-max-drafts", "1"])
    assert _spec_config(args) == {"method": "repeat", "repeat_max_drafts": 1, "num_speculative_tokens": 4}


def test_it_runs_and_greedy_output_is_unchanged(repeat_registered, tiny_models):
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_gb=0.02)
    prompts = ["a a a a a a", "1 2 3 4 5 6 7 8"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny_models["llama"]), **kwargs).generate(prompts, params)]
    llm = LLM(str(tiny_models["llama"]), **kwargs,
              speculative_config={"method": "repeat", "num_speculative_tokens": 4, "repeat_max_drafts": 2,
                                  "adaptive_draft_length": False})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.stats()
    assert stats["num_drafted"] > 0 and stats["num_drafted"] <= 2 * stats["num_steps"]
