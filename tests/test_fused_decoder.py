"""The decoder layers and final norm in one C call (eyas/model/fused_decoder.py) against the same modules one by
one.

The C loop calls the modules' own kernels in the modules' order, so every forward's hidden and aux states
must equal the module path's bit for bit, whatever the batch: decodes, short verification chains, chunked
prompts that go through SDPA (where the loop steps aside), preemption, and self-drafting over the first
layers.
"""

import pytest
import torch
from engine_helpers import run_counting_preemptions
from test_gguf_quantized import write_quantized_gguf
from test_quant_kernels import NEEDS_MEDIUM

from eyas import LLM, SamplingParams
from eyas.model import quantized as Q
from eyas.model.fused_decoder import FusedDecoder

pytestmark = pytest.mark.skipif(not Q.kernel_available(), reason="no C compiler: the native kernels cannot be built")

PROMPTS = [[5, 60, 61, 200, 7, 9, 60, 61, 200], [100, 101, 102, 100, 101, 102, 100, 101], [7] * 40,
           list(range(30, 90)), [11, 12], list(range(100, 200))]


def _recording(llm):
    """A list that gets every target forward's (hidden, aux) from now on, a counter of the C loop's runs and
    the ``FusedDecoder.run`` that counts them."""
    model, seen, calls = llm.engine.runner.model, [], {"fused": 0}
    forward, run = model.forward, FusedDecoder.run

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((out.hidden.clone(), None if out.aux_hidden is None else out.aux_hidden.clone()))
        return out

    def counted(self, *args, **kwargs):
        calls["fused"] += 1
        return run(self, *args, **kwargs)

    model.forward = record
    return seen, calls, counted


def _generate(path, monkeypatch, fused: bool, mode: str, aux=(), spec=None, **kwargs):
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(FusedDecoder, "build", classmethod(lambda cls, layers, norm: None))
        llm = LLM(str(path), quantization=mode, max_model_len=256, speculative_config=spec,
                  **({"kv_cache_gb": 0.05} | kwargs))
        if aux:
            llm.engine.runner.model.set_aux_layer_ids(aux)
        seen, calls, counted = _recording(llm)
        m.setattr(FusedDecoder, "run", counted)
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        outputs, preemptions = run_counting_preemptions(llm, PROMPTS, params)
    return [o.outputs[0].token_ids for o in outputs], seen, calls["fused"], preemptions


def _assert_same_states(fused, modules):
    assert len(fused) == len(modules)
    for (h_f, aux_f), (h_m, aux_m) in zip(fused, modules):
        assert torch.equal(h_f, h_m)
        assert (aux_f is None and aux_m is None) or torch.equal(aux_f, aux_m)


@pytest.mark.parametrize("mode,precision", [("gguf", "highest"), ("int8", "highest"), ("bf16", "highest"),
                                            pytest.param("gguf", "medium", marks=NEEDS_MEDIUM)])
def test_fused_layers_equal_the_modules_bit_for_bit(tmp_path, monkeypatch, mode, precision):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    # aux ids out of order, with the embeddings (0) and the last layer's output (2), copied out by the loop
    kwargs = dict(mode=mode, aux=(2, 0, 1), max_num_batched_tokens=32, matmul_precision=precision)
    tokens_f, states_f, runs, _ = _generate(path, monkeypatch, True, **kwargs)
    tokens_m, states_m, no_runs, _ = _generate(path, monkeypatch, False, **kwargs)
    assert runs > 0 and no_runs == 0  # the loop ran, and the reference did not use it
    assert tokens_f == tokens_m
    _assert_same_states(states_f, states_m)


def test_fused_layers_under_preemption_and_self_drafting(tmp_path, monkeypatch):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    spec = {"method": "draft_model", "draft_num_layers": 1, "num_speculative_tokens": 3, "draft_row_cost": 0.0}
    kwargs = dict(mode="gguf", spec=spec, num_kv_blocks=18, max_num_batched_tokens=32)
    tokens_f, states_f, runs, preempted = _generate(path, monkeypatch, True, **kwargs)
    tokens_m, states_m, _, _ = _generate(path, monkeypatch, False, **kwargs)
    assert runs > 0 and preempted > 0
    assert tokens_f == tokens_m
    _assert_same_states(states_f, states_m)
    plain, _, _, _ = _generate(path, monkeypatch, True, mode="gguf")
    assert tokens_f == plain


def test_fused_layers_step_aside_where_a_layer_has_no_native_kernel(tmp_path):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    model = LLM(str(path), quantization=None, kv_cache_gb=0.05, max_model_len=256).engine.runner.model
    assert FusedDecoder.build(model.layers, model.norm) is None  # float32 nn.Linear weights
    quantized = LLM(str(path), quantization="gguf", kv_cache_gb=0.05, max_model_len=256).engine.runner.model
    assert FusedDecoder.build(quantized.layers, quantized.norm) is not None
    quantized.norm.eps *= 2
    assert FusedDecoder.build(quantized.layers, quantized.norm) is None  # the loop's norms share one eps
    quantized.norm.eps /= 2
    quantized.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(256))
    assert FusedDecoder.build(quantized.layers, quantized.norm) is None  # a bias: the C loop adds none


@pytest.mark.slow
def test_fused_layers_equal_the_modules_on_the_real_default_model(monkeypatch):
    """SmolLM2-135M in its own Q4_1/Q8_0 GGUF (9 query heads over 3 KV heads), with EAGLE-3's aux layers."""
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356], list(range(400, 431)), [28, 29]]

    def states(fused: bool):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(FusedDecoder, "build", classmethod(lambda cls, layers, norm: None))
            llm = LLM(None, max_model_len=256, kv_cache_gb=0.02)
            assert llm.engine.config.quantization == "gguf"
            llm.engine.runner.model.set_aux_layer_ids((2, 15, 27))
            seen, calls, counted = _recording(llm)
            m.setattr(FusedDecoder, "run", counted)
            out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in out], seen, calls["fused"]

    tokens_f, states_f, runs = states(True)
    tokens_m, states_m, _ = states(False)
    assert runs > 0
    assert tokens_f == tokens_m
    _assert_same_states(states_f, states_m)


@pytest.mark.skipif(not Q.kernel_available("low"), reason="no integer dot-product kernel on this CPU")
def test_a_precision_set_after_a_forward_gets_a_new_plan(tmp_path):
    """The C loop's plan holds each product's kernel calls; a precision set after the plan was made (which also
    interleaves the weights in place) must not run the old calls on the moved bytes."""
    from eyas.model.loader import set_matmul_precision

    path = write_quantized_gguf(tmp_path / "q.gguf")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def llm(precision):
        return LLM(str(path), quantization="gguf", matmul_precision=precision, max_model_len=256, kv_cache_gb=0.05)

    want = [o.outputs[0].token_ids for o in llm("low").generate(PROMPTS, params, use_tqdm=False)]
    switched = llm("highest")
    switched.generate(PROMPTS[:1], params, use_tqdm=False)  # the plan is made at "highest"
    set_matmul_precision(switched.engine.runner.model, "low")
    assert [o.outputs[0].token_ids for o in switched.generate(PROMPTS, params, use_tqdm=False)] == want
