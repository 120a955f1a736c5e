"""The budget-aware close (``eyas.sampling.grammar_budget``): a reply that max_tokens would cut inside its grammar
comes back complete and valid; a reply that finished within its budget is unchanged; speculation changes nothing."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from eyas import LLM, SamplingParams
from eyas.model.resolve import resolve_model
from eyas.model.tokenizer import Tokenizer
from eyas.sampling.grammar import GrammarCompiler, _single_token
from eyas.tools import ToolRequest, parse_reply
from eyas.tools.grammar import tool_grammar
from eyas.tools.hermes import HERMES

EMAIL = {"type": "function", "function": {"name": "send_email", "parameters": {
    "type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                     "body": {"type": "string"}}, "required": ["to", "subject", "body"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
# strings of plain letters (a byte-level tokenizer's random model writes partial UTF-8 characters otherwise,
# which lengthen a completion by a token the close does not look ahead for), capped so replies also end by
# themselves
SCHEMA = {"type": "object", "required": ["to", "body"], "properties": {
    "to": {"type": "string", "pattern": "^[a-z]*$", "maxLength": 6},
    "body": {"type": "string", "pattern": "^[a-z ]*$", "maxLength": 14}}}


def test_a_looping_call_is_closed_within_its_budget():
    """A stand-in model on the default tokenizer that writes the email call and then repeats its body for ever:
    at every budget from the shortest call's length (at most the length of the call with an empty body) up to 96,
    the reply ends with EOS within the budget and its call validates; below it the reply is cut, or its call
    ends on the last token (no room for EOS), and validates."""
    tokenizer = Tokenizer.from_folder(resolve_model(None))
    compiler = GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
    grammar = compiler.compile({"grammar": tool_grammar(ToolRequest.from_openai([EMAIL, SEARCH], "required",
                                                                                 False))})
    start = '<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c", "subject": "Offsite", "body": "'
    wanted = tokenizer.encode(start + "Moved to Friday." + " Moved to Friday." * 40, add_special_tokens=False)
    estimate = len(tokenizer.encode(start + '"}}\n</tool_call>', add_special_tokens=False)) + 1  # and EOS
    fits = []
    for budget in range(estimate - 12, 97):
        state, reply = compiler.state(grammar, budget), []
        while len(reply) < budget and (not reply or reply[-1] not in state.eos_token_ids):
            mask = state.bitmask()
            token = wanted[len(reply)] if len(reply) < len(wanted) else None
            if token is None or not mask[token >> 5] >> (token & 31) & 1:
                token = _single_token(mask)
                assert token is not None, f"budget {budget}: the model left the call at {len(reply)} tokens"
            reply.append(token)
            if token not in state.eos_token_ids:
                state.advance(token)
        calls = parse_reply(tokenizer.decode([t for t in reply if t not in state.eos_token_ids]), HERMES).calls
        fits.append(reply[-1] in state.eos_token_ids)
        if not calls:  # nothing fits: cut, as before
            assert not fits[-1]
            continue
        assert len(reply) <= budget and [c.name for c in calls] == ["send_email"]
        arguments = json.loads(calls[0].arguments)
        jsonschema.validate(arguments, EMAIL["function"]["parameters"])
        assert ("Moved to Friday." + " Moved to Friday." * 40).startswith(arguments["body"])  # the model's, closed
    shortest = fits.index(True)
    assert 0 < shortest <= 12 and all(fits[shortest:])  # every budget from the shortest call's length up


def _prompts() -> list[list[int]]:
    return [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (5, 9, 17, 30, 3, 12, 7, 21)]


@pytest.mark.parametrize("method", [None, "ngram", "eagle3"])
def test_cut_replies_come_back_complete_and_finished_ones_unchanged(tiny_models, drafters, method):
    """On a tiny random model, greedy: at budgets around each reply's own length (and far below it), a reply
    that fits its budget is token for token the reply of an unlimited budget; one that does not fit ends by
    its grammar (finish "stop") within the budget, valid against the schema. With n-gram drafts and with an
    EAGLE-3 drafter (which samples its drafts under the grammar too) every reply equals the one without
    speculation, and the closing tokens are forced drafts."""
    path = str(tiny_models["llama"])
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
            "eagle3": {"method": "eagle3", "model": drafters.folders["eagle3"], "num_speculative_tokens": 3}}.get(method)
    plain = LLM(path, dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    prompts = _prompts()
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=200, structured_output={"json": SCHEMA}),
                          use_tqdm=False)
    natural = [o.outputs[0].token_ids for o in free]
    assert all(o.outputs[0].finish_reason == "stop" for o in free)
    llm = plain if spec is None else LLM(path, dtype="float32", max_model_len=256, kv_cache_gb=0.05,
                                         speculative_config=spec)
    lengths = sorted({len(t) for t in natural})
    budgets = sorted({28, 33, *[n - 1 for n in lengths], *lengths})
    cut = 0
    for budget in budgets:
        params = SamplingParams(temperature=0, max_tokens=budget, structured_output={"json": SCHEMA})
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, own in zip(outs, natural):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop" and len(completion.token_ids) <= budget
            jsonschema.validate(json.loads(completion.text), SCHEMA)
            if len(own) <= budget:
                assert completion.token_ids == own, budget
            else:
                cut += 1
        if spec is not None:
            assert [o.outputs[0].token_ids for o in outs] == \
                [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert cut >= len(prompts)  # the close was exercised
    if spec is not None:
        stats = llm.stats()
        assert stats["num_forced"] == stats["num_forced_accepted"] > 0
