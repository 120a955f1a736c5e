"""EAGLE, EAGLE-3 and MTP drafters inside the engine: lossless greedy output, and engine drafts equal
an independent one-request-at-a-time reference (``drafter_reference``, from formats.md)."""

from __future__ import annotations

from pathlib import Path

import drafter_reference as ref
import pytest
import torch
import transformers
from conftest import K
from engine_helpers import run_counting_preemptions

from eyas import LLM, SamplingParams

CASES = {  # name -> (method, model folder key, the LLM's target: the drafter's own folder for MTP)
    "eagle": ("eagle", "eagle"),
    "eagle3": ("eagle3", "eagle3"),
    "eagle3_speculators": ("eagle3", "eagle3_speculators"),
    "eagle3_2_layers": ("eagle3", "eagle3_2_layers"),  # a second, plain decoder layer (vLLM's num_hidden_layers 2)
    "peagle": ("eagle3", "peagle"),  # parallel drafting (P-EAGLE): drafts 2..k from one forward of mask rows
    "peagle_speculators": ("eagle3", "peagle_speculators"),
    "mtp_1": ("mtp", "mtp_1"),
    "mtp_2_sliding_full": ("mtp", "mtp_2_sliding_full"),
    "mtp_2": ("mtp", "mtp_2"),
}


def _llm(drafters, case, spec_over=None, **over):
    method, key = CASES[case]
    folder = drafters.folders[key]
    target = folder if method == "mtp" else str(drafters.target)
    # these tests check what is drafted, not whether a drafter's step pays (eyas.spec_decode.adaptive): free steps
    spec = {"method": method, "num_speculative_tokens": K, "draft_step_cost": 0.0, **(spec_over or {})}
    if method != "mtp":
        spec["model"] = folder
    if key.startswith("peagle"):
        spec["parallel_drafting"] = True
    kw = dict(dtype="float32", max_model_len=256, kv_cache_gb=0.05, speculative_config=spec)
    kw.update(over)
    return LLM(target, **kw)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 40, 17, 70, 3, 33, 50, 9][:n]
    return [torch.randint(0, 300, (m,), generator=g).tolist() for m in lengths]


@pytest.mark.parametrize("case", [c for c in CASES if c != "mtp_2"])
def test_greedy_speculation_equals_plain_batch_1_and_8_with_preemption(drafters, case):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    prompts = _prompts(8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    alone = _llm(drafters, case).generate(prompts[:1], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == want[0]
    assert alone.spec_metrics["num_drafted"] > 0
    tight = _llm(drafters, case, num_kv_blocks=24, max_num_batched_tokens=32)  # preemption + chunked prefill
    outs, preemptions = run_counting_preemptions(tight, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want and preemptions > 0


@pytest.mark.parametrize("case", ["eagle3", "mtp_1"])
def test_bf16_target_and_int8_drafter_rows_stay_lossless(drafters, case):
    """quantization='bf16': the target's matrices are bf16 rows on eyas's kernel and the drafter's Q8_0 blocks;
    each drafter product equals its float32 module's on the same rounded weights, and greedy output is plain's."""
    from eyas.model.layers import Linear
    from eyas.model.quantized import QuantLinear, dequantize, quantize_q8_0

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    target = drafters.folders["mtp_1"] if case == "mtp_1" else str(drafters.target)
    plain = LLM(target, dtype="float32", quantization="bf16", max_model_len=256, kv_cache_gb=0.05)
    prompts = _prompts(8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _llm(drafters, case, quantization="bf16")
    rows = dict(llm.engine.runner.proposer.drafter.named_modules())
    floats = _llm(drafters, case).engine.runner.proposer.drafter
    checked = 0
    for name, module in floats.named_modules():
        if isinstance(module, Linear):
            got = rows[name]
            assert isinstance(got, QuantLinear), name
            rounded = dequantize(quantize_q8_0(module.weight))
            assert got.parts[0].fmt.name == "Q8_0" and torch.equal(dequantize(got.parts[0]), rounded), name
            x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(checked))
            torch.testing.assert_close(got(x), x @ rounded.T, rtol=1e-5, atol=1e-5)
            checked += 1
    assert checked >= 4
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], params, use_tqdm=False)] == want[:1]
    tight = _llm(drafters, case, quantization="bf16", num_kv_blocks=24, max_num_batched_tokens=32)
    outs, preemptions = run_counting_preemptions(tight, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want and preemptions > 0
    assert llm.stats()["num_drafted"] > 0


@pytest.mark.parametrize("case", ["eagle", "eagle3", "mtp_2"])
def test_penalties_stay_lossless_under_hidden_state_drafters(drafters, case):
    penalties = dict(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3, logit_bias={7: 2.0})
    prompts = _prompts(8)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    llm = _llm(drafters, case, spec_over={"verification": "shared_noise"})
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **penalties),
                   SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True, **penalties)):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.stats()["num_drafted"] > 0


def test_speculators_folder_gives_the_default_k(drafters):
    llm = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05,
              speculative_config={"method": "eagle3", "model": drafters.folders["eagle3_speculators"]})
    assert llm.engine.config.speculative.num_speculative_tokens == K


def _record_drafts(llm, proposer=None) -> dict:
    """Wrap the proposer (``proposer``: the one inside the engine's): ``records`` gets (tokens, drafts) of every row
    it drafts, ``caught_up`` those of rows that had drafted before, then skipped steps, and whose draft prefill
    caught up over them (``eyas.spec_decode.catch_up``); ``skipped`` counts the rows it left out."""
    proposer = proposer or llm.engine.runner.proposer
    seen = {"records": [], "caught_up": [], "skipped": 0}
    batches, drafted = [], set()
    original, original_batch = proposer.propose, proposer.catch_up.batch if proposer.catch_up else None

    def batching(inp, next_ids, hidden):
        batches.append(original_batch(inp, next_ids, hidden))
        return batches[-1]

    def recording(inp):
        batches.clear()
        out = original(inp)
        batch = batches[0] if batches else None
        for r, b in enumerate(inp.sample_rows):
            if int(out.num_drafts[r]) == 0:
                seen["skipped"] += 1
                continue
            emitted = inp.emitted[r, :int(inp.num_emitted[r])].tolist()
            record = (inp.token_ids[r] + emitted, out.draft_token_ids[r, :int(out.num_drafts[r])].tolist())
            seen["records"].append(record)
            if batch is not None and inp.request_ids[r] in drafted:
                i = batch.requests.index(b)
                query = batch.query_start_loc[i + 1] - batch.query_start_loc[i]
                if query > inp.query_start_loc[b + 1] - inp.query_start_loc[b]:
                    seen["caught_up"].append(record)
            drafted.add(inp.request_ids[r])
        return out

    proposer.propose = recording
    if proposer.catch_up:
        proposer.catch_up.batch = batching
    return seen


def _assert_reference_drafts(drafters, case, records) -> None:
    """Each recorded row's drafts equal the dense reference's chain over that request alone."""
    method, key = CASES[case]
    hf = transformers.AutoModelForCausalLM.from_pretrained(drafters.target, dtype=torch.float64).eval()
    emb, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    folder = Path(drafters.folders[key])
    reference = {"eagle": lambda: ref.Eagle1(folder, emb, head), "eagle3": lambda: ref.Eagle3(folder, emb),
                 "mtp": lambda: ref.Mtp(folder, emb, head)}[method]()
    for tokens, drafts in records:
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i][0] for i in (0, 1, 2)], -1) if method == "eagle3" else states[-1][0]
        if key.startswith("peagle"):
            want, _ = ref.greedy_parallel(reference, tokens, hidden, len(drafts))
        else:
            want, _ = ref.greedy_chain(reference, tokens, hidden, len(drafts))
        assert drafts == want


@pytest.mark.parametrize("case", ["eagle", "eagle3", "eagle3_2_layers", "peagle", "peagle_speculators", "mtp_1",
                                  "mtp_2"])
def test_engine_drafts_equal_one_request_reference(drafters, case):
    """Every step's drafts of a batched run equal the dense reference's chain over that request alone, the
    drafts of requests that skipped steps while the adaptive policy paused them (caught up) included.

    mtp_2: two MTP layers of distinct weights, step j on layer j % 2, positions held (its window of 64
    is longer than these sequences; the SDPA tests check windows that bite)."""
    # chunked prefill too; a fixed row cost (not this machine's measured curve) so that the policy pauses requests
    llm = _llm(drafters, case, spec_over={"draft_row_cost": 0.07}, max_num_batched_tokens=32)
    seen = _record_drafts(llm)
    llm.generate(_prompts(3, seed=3), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(seen["records"]) >= 3 * 5 and seen["caught_up"]
    _assert_reference_drafts(drafters, case, seen["records"])


def test_drafts_after_suffix_decoding_took_over_equal_the_reference(drafters):
    """With ``enable_suffix_decoding`` a request whose suffix draft is taken skips the drafter (and verifies
    suffix drafts); when it takes the drafter's again, those drafts equal the dense reference chain: the drafter
    caught up over the tokens verified meanwhile."""
    llm = _llm(drafters, "eagle3", spec_over={"enable_suffix_decoding": True, "draft_row_cost": 0.0,
                                              "num_speculative_tokens": 1})  # suffix drafts scoring 1 are taken
    hybrid = llm.engine.runner.proposer
    seen = _record_drafts(llm, hybrid.drafter)
    prompts = [p * 3 for p in _prompts(3, seed=3)]  # repeats for suffix decoding to find
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert hybrid.suffix_rows > 0 and len(seen["caught_up"]) >= 3, (hybrid.suffix_rows, len(seen["caught_up"]))
    _assert_reference_drafts(drafters, "eagle3", seen["records"])


def _skip_every_third_step(llm) -> None:
    """Make the scheduler tell each request 0 at one step in three (offset per request), whatever the cost model says."""
    scheduler = llm.engine.scheduler
    original, steps = scheduler._expected_drafts, iter(range(10**6))

    def forced(scheduled):
        step = next(steps)
        return {i: 0 if (step + sum(map(ord, i))) % 3 == 0 else n for i, n in original(scheduled).items()}

    scheduler._expected_drafts = forced


@pytest.mark.parametrize("case", ["eagle3", "eagle3_2_layers", "peagle", "mtp_1", "mtp_2_sliding_full"])
def test_requests_draft_again_after_skipped_steps_batch_1_and_8_with_preemption(drafters, case):
    """Requests told 0 skip the drafter, then draft again; greedy output equals plain output, and a caught-up
    request drafts what a drafter that never skips drafts at the same history (mtp_2_sliding_full: a window
    of 8 that bites), through preemptions and chunked prefill too."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    prompts = _prompts(8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    never = _llm(drafters, case, spec_over={"adaptive_draft_length": False})  # told k always
    unskipped = _record_drafts(never)
    never.generate(prompts, params, use_tqdm=False)
    assert unskipped["skipped"] == 0
    oracle = {tuple(tokens): drafts for tokens, drafts in unskipped["records"]}
    alone = _llm(drafters, case, spec_over={"draft_row_cost": 0.0})  # only the forced skips and pauses
    tight = _llm(drafters, case, spec_over={"draft_row_cost": 0.0}, num_kv_blocks=24, max_num_batched_tokens=32)
    for llm in (alone, tight):
        _skip_every_third_step(llm)
        seen = _record_drafts(llm)
        if llm is alone:
            assert [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:2]] == want[:2]
        else:
            outs, preemptions = run_counting_preemptions(llm, prompts, params)
            assert [o.outputs[0].token_ids for o in outs] == want and preemptions > 0
        assert seen["skipped"] > 0
        compared = [(drafts, oracle[tuple(tokens)]) for tokens, drafts in seen["caught_up"] if tuple(tokens) in oracle]
        assert len(compared) >= 3 and all(got == expected[:len(got)] for got, expected in compared)  # a chain cut short


def test_a_drafter_the_cost_model_rejects_at_batch_16_never_runs_its_head(drafters):
    """At batch 16 with the CPU costs (rows 0.07, the drafter's 0.11 a step and 0.18 a pass, and its measured growth),
    drafts at the prior acceptance do not pay: the scheduler tells every request 0 and the EAGLE-3 drafter skips its
    prefill, head and decode steps; output equals plain greedy. Alone, it drafts."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = _prompts(8) + _prompts(8, seed=1)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # the row cost fixed at the docstring's 0.07, not this machine's measured curve; the step's cost is the drafter's own
    llm = _llm(drafters, "eagle3", spec_over={"draft_step_cost": None, "draft_row_cost": 0.07})
    step_cost = llm.engine.scheduler.drafts.step_cost  # 0.11 + 0.18 a pass at one request, grown by the products
    assert step_cost(1, 2) == pytest.approx(0.47) and step_cost.products is not None
    assert step_cost(16, 2) > step_cost(8, 2) > 0.47
    proposer = llm.engine.runner.proposer
    calls = {"propose": 0, "prefill": 0, "head": 0, "decode": 0}

    def count(obj, name, label):
        original = getattr(obj, name)

        def counting(*args):
            calls[label] += 1
            return original(*args)

        setattr(obj, name, counting)

    count(proposer, "propose", "propose")
    count(proposer, "_prefill_step", "prefill")
    count(proposer.drafter, "compute_logits", "head")
    count(proposer, "_draft_step", "decode")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert calls == {"propose": 16, "prefill": 0, "head": 0, "decode": 0}  # one call a step, nothing run
    llm.generate(prompts[:1], params, use_tqdm=False)
    assert calls["prefill"] > 0 and calls["head"] > 0  # alone it drafts (as deep as it expects to verify)


def test_prompts_cost_the_drafter_nothing_until_their_request_drafts(drafters):
    """With adaptive drafting the draft prefill runs only over requests that draft. 8 requests with chunked
    prompts, all told 0, run no draft prefill at all, and their output equals plain greedy. A request that then
    shares one of those prompts' blocks through the prefix cache drafts what the dense reference drafts: its first
    draft prefill catches up over the shared blocks, which the drafter never saw."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [p * 3 for p in _prompts(8, seed=4)]  # 9 to 210 tokens
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _llm(drafters, "eagle3", spec_over={"draft_row_cost": 0.0}, max_num_batched_tokens=64)
    scheduler, proposer = llm.engine.scheduler, llm.engine.runner.proposer
    expected, prefill = scheduler._expected_drafts, proposer._prefill_step
    scheduler._expected_drafts = lambda scheduled: dict.fromkeys(expected(scheduled), 0)
    rows = []

    def counting(input_ids, positions, hidden):
        rows.append(len(input_ids))
        return prefill(input_ids, positions, hidden)

    proposer._prefill_step = counting
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert rows == [] and llm.stats()["num_drafted"] == 0
    scheduler._expected_drafts = expected
    seen = _record_drafts(llm)
    shared = prompts[3] + [5, 6]  # the prefix cache holds the 13 full blocks of prompts[3]
    out = llm.generate([shared], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.generate([shared], params, use_tqdm=False)[0].outputs[0].token_ids
    assert rows[0] == len(shared) and len(seen["records"]) >= 3
    _assert_reference_drafts(drafters, "eagle3", seen["records"])


def test_speculators_folder_as_the_model_names_target_and_k(drafters):
    llm = LLM(drafters.folders["eagle3_speculators"], dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    spec = llm.engine.config.speculative
    assert llm.engine.config.model.path == Path(drafters.target)
    assert (spec.method, spec.options.model, spec.num_speculative_tokens) == ("eagle3", drafters.folders["eagle3_speculators"], K)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    prompt = _prompts(1)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model: method 'eagle' needs the drafter"),
    ({"method": "eagle"}, "num_speculative_tokens: missing"),
    # eyas ships an EAGLE-3 drafter for its default model only
    ({"method": "eagle3", "num_speculative_tokens": 2}, "eyas ships no eagle3 drafter for the target"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "parallel_drafting": True},
     "eyas ships no parallel eagle3 drafter for the target"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "MTP"}, "does not match"),
    # a parallel drafter runs only as one, and drafts at most the depths it was trained for
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "PEAGLE"}, "parallel_drafting: False, but .* is a "
                                                                           "parallel"),
    ({"method": "eagle3", "num_speculative_tokens": 2, "model": "EAGLE3", "parallel_drafting": True},
     "parallel_drafting: True, but .* is a chain drafter"),
    ({"method": "eagle3", "num_speculative_tokens": 5, "model": "PEAGLE", "parallel_drafting": True},
     "num_speculative_tokens: 5 exceeds the 4 depths .*parallel_drafting_depths"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "MTP", "parallel_drafting": True},
     "parallel_drafting: not used by method 'mtp'"),
])
def test_speculator_misconfigurations(drafters, spec, message):
    names = {"MTP": "mtp_1", "PEAGLE": "peagle", "EAGLE3": "eagle3"}
    spec = {k: drafters.folders[names[v]] if v in names else v for k, v in spec.items()}
    with pytest.raises(ValueError, match=message):
        LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05, speculative_config=spec)


@pytest.mark.parametrize("case", ["eagle3", "peagle", "mtp_2_sliding_full"])
def test_seeded_sampling_with_shared_noise_is_token_identical_to_plain(drafters, case):
    """Drafts drawn with the target's own keyed noise keep seeded sampling token-identical."""
    params = [SamplingParams(temperature=t, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True)
              for t, s in ((0.7, 1), (1.0, 2), (0.3, 3))]
    prompts = _prompts(3, seed=4)
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = _llm(drafters, case, {"verification": "shared_noise"})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.spec_metrics["num_drafted"] for o in outs) > 0


def test_cli_generate_with_a_speculators_drafter_uses_its_k(drafters, capsys):
    from eyas.cli import main

    code = main(["generate", "hello", "--model", str(drafters.target), "--max-tokens", "6", "--kv-cache-gb", "0.02",
                 "--max-model-len", "128", "--spec-method", "eagle3", "--spec-model",
                 drafters.folders["eagle3_speculators"]])
    assert code == 0 and "speculation: drafted" in capsys.readouterr().err


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _drafts_per_step(llm, prompts, params) -> tuple[list, list]:
    """(every step's drafts as lists, the outputs' token ids)."""
    proposer = llm.engine.runner.proposer
    steps, original = [], proposer.propose

    def recording(inp):
        out = original(inp)
        steps.append(out.draft_token_ids.tolist())
        return out

    proposer.propose = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    return steps, [o.outputs[0].token_ids for o in outs]


def _mixed_batch():
    """Batch sizes 7 down to 1 (off the ladder), chunked prompts beside decodes, preemption-free."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 9, 14, 6, 20, 11, 17)]
    return _prompts(7, seed=5), params


@pytest.mark.parametrize("case", ["eagle", "eagle3", "peagle", "mtp_1", "mtp_2_sliding_full"])
def test_graph_layout_run_eagerly_proposes_the_eager_drafts(drafters, case):
    """The padded layout that CUDA graphs replay (batch padded up the ladder, queries to k+1 rows per
    request, block tables to a power of two), run eagerly on the CPU, drafts exactly what the flat path does."""
    from eyas.model.cuda_graphs import StepGraphs

    prompts, params = _mixed_batch()
    # a row cost (the line c = 0.07) under which 5 or more decoding requests draft together in this batch; the
    # budget chunks the 70-token prompt, whose drafter rows are caught up (eagerly) when it first drafts
    kw = dict(spec_over={"draft_row_cost": 0.07}, max_num_batched_tokens=64)
    want = _drafts_per_step(_llm(drafters, case, **kw), prompts, params)
    llm = _llm(drafters, case, **kw)
    graphs = llm.engine.runner.proposer.layout_forward.graphs = StepGraphs(torch.device("cpu"), 64, capture=False)
    llm.engine.runner.target.graphs = StepGraphs(torch.device("cpu"), 64, capture=False)  # the target's aux states too
    keys, original = [], graphs.run

    def recording(key, fn, *inputs):
        keys.append(key)
        return original(key, fn, *inputs)

    graphs.run = recording
    assert _drafts_per_step(llm, prompts, params) == want
    prefill_sizes = {size for label, size, _, _ in keys if label == "prefill"}
    assert {1, 2, 4, 8} <= prefill_sizes  # 7, 5, 3 requests decoding were padded up
    labels = {label for label, *_ in keys}
    # a chain stops where the scheduler expects to stop verifying: mtp_2's second step layer may be all it runs
    decodes = {label for label in labels if label.startswith("decode.")}
    assert labels >= {"prefill", "parallel"} if case == "peagle" else "prefill" in labels and decodes


@needs_cuda
@pytest.mark.parametrize("case", ["eagle3", "peagle", "mtp_2_sliding_full"])
def test_cuda_graphs_propose_the_eager_drafts(drafters, case):
    prompts, params = _mixed_batch()
    kw = dict(device="cuda", max_num_batched_tokens=48)
    eager = _drafts_per_step(_llm(drafters, case, enforce_eager=True, **kw), prompts, params)
    llm = _llm(drafters, case, **kw)
    graphed = _drafts_per_step(llm, prompts, params)
    assert llm.engine.runner.proposer.layout_forward.graphs.num_graphs > 0
    assert graphed == eager
    plain = LLM(str(drafters.target), dtype="float32", max_model_len=256, kv_cache_gb=0.05, device="cuda")
    assert graphed[1] == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
