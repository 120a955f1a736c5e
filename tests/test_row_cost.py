"""The row-cost curve adaptive drafting prices drafts with (``eyas/runner/row_cost.py``): measured once per CPU,
weight format, matmul precision and threads, kept in the cache folder, read afterwards; a changed record changes
how many drafts are verified; an explicit ``draft_row_cost`` wins without measuring. A drafter's products are
recorded alike, per drafter."""

import json

import pytest
from test_gguf_quantized import write_quantized_gguf
from torch import nn

from eyas import LLM
from eyas.model import quantized as Q
from eyas.runner import row_cost
from eyas.spec_decode.adaptive import RowCost, allocate_drafts

pytestmark = pytest.mark.skipif(not Q.kernel_available(), reason="no C compiler: the quantized kernel cannot be built")

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture
def records(tmp_path, monkeypatch):
    """The records' folder, empty, under tmp_path (the kernels' cache is left where it is)."""
    monkeypatch.setattr(row_cost, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "row-costs"


def _llm(path, precision="highest", **spec):
    return LLM(str(path), quantization="gguf", matmul_precision=precision, kv_cache_gb=0.05, max_model_len=256,
               num_threads=1, speculative_config={**SPEC, **spec})


def test_the_curve_is_measured_once_then_read(tmp_path, records, monkeypatch):
    path = write_quantized_gguf(tmp_path / "q.gguf")
    first = _llm(path).engine.scheduler.drafts.row_cost
    [record] = records.glob("*.json")
    saved = json.loads(record.read_text())
    assert saved["rows"] == list(row_cost.ROWS) and saved["costs"][0] == 1.0
    assert saved["costs"] == sorted(saved["costs"])  # a row never costs less than none
    # attention per key: the committed row reads the K/V, a further row adds its arithmetic
    assert 0 < saved["per_key"] < saved["first_key"] < 0.01
    assert first == RowCost(tuple(zip(saved["rows"], saved["costs"])), saved["first_key"], saved["per_key"])

    def no_measuring(*_):
        raise AssertionError("measured again")
    monkeypatch.setattr(row_cost, "measure", no_measuring)
    assert _llm(path).engine.scheduler.drafts.row_cost == first  # read, not measured
    assert _llm(path, draft_row_cost=0.5).engine.scheduler.drafts.row_cost == RowCost.linear(0.5)
    if Q.kernel_available("low"):  # another matmul precision is another record
        monkeypatch.undo()
        monkeypatch.setattr(row_cost, "cache_dir", lambda: tmp_path / "cache")
        _llm(path, "low")
        assert len(list(records.glob("*.json"))) == 2


def test_a_changed_record_changes_the_decision(tmp_path, records):
    """The same request and acceptance: on a flat recorded curve all 4 drafts are verified, on a steep one none;
    on the flat curve with a recorded attention cost, all 4 at a context of 100 keys and 1 at 4,000 (each draft row
    reads them all), and 3 when the committed row's own attention makes the step dearer (drafts then cost less of
    it)."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    _llm(path)
    [record] = records.glob("*.json")
    decisions = {}
    flat = [1.0 + 0.01 * (n - 1) for n in row_cost.ROWS]
    for name, costs, first_key, per_key in [("flat", flat, 0.0, 0.0), ("steep", [float(n) for n in row_cost.ROWS],
                                             0.0, 0.0), ("attention", flat, 0.0, 1e-4),
                                            ("dear step", flat, 5e-4, 1e-4)]:
        record.write_text(json.dumps({"rows": list(row_cost.ROWS), "costs": costs, "first_key": first_key,
                                      "per_key": per_key, "what": name}))
        cost = _llm(path).engine.scheduler.drafts.row_cost
        assert cost(16) == costs[-1] and (cost.first_key, cost.per_key) == (first_key, per_key)
        decisions[name] = [allocate_drafts([(4, 0.7, 0)], 1, cost, max_drafts=4, contexts=[context])[0]
                           for context in (100, 4000)]
    assert decisions == {"flat": [4, 4], "steep": [0, 0], "attention": [4, 1], "dear step": [4, 3]}
    for broken in ("not json", json.dumps({"rows": list(row_cost.ROWS), "costs": flat})):  # no attention: old
        record.write_text(broken)  # a record that cannot be read is measured again
        assert _llm(path).engine.scheduler.drafts.row_cost(1) == 1.0
        assert json.loads(record.read_text())["rows"] == list(row_cost.ROWS)
        assert json.loads(record.read_text())["per_key"] > 0


def test_a_drafters_products_are_measured_once_per_drafter_then_read(records, monkeypatch):
    """In one-row passes of the target's products: a drafter that is a copy of the target costs about 1 at one
    row; the record is read afterwards; another drafter gets its own record. (Products of 16 MB, not cache-sized:
    on a Zen 4 guest a 2 MB one-row product timed right after a 64-row one took 1.3-3x its time after a one-row
    one.)"""
    target = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    twin = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    first = row_cost.measured_draft_products(twin, target, None, "highest", 1)
    [record] = records.glob("*.json")
    saved = json.loads(record.read_text())
    assert saved["rows"] == list(row_cost.DRAFT_ROWS) and saved["costs"] == sorted(saved["costs"])
    assert 0.5 < saved["costs"][0] < 2.0  # the same work as the target's one row
    assert first == RowCost(tuple(zip(saved["rows"], saved["costs"])))

    def no_measuring(*_):
        raise AssertionError("measured again")
    monkeypatch.setattr(row_cost, "_fastest", no_measuring)
    assert row_cost.measured_draft_products(twin, target, None, "highest", 1) == first
    with pytest.raises(AssertionError, match="measured again"):  # another drafter shape: another record
        row_cost.measured_draft_products(nn.Sequential(nn.Linear(1024, 64)), target, None, "highest", 1)


def test_another_kernel_build_is_measured_anew(tmp_path, records, monkeypatch):
    """The record's key holds the kernel builds the engine runs (their sources and which ISA build): the AMX tiles
    changed the 16-row cost from 2.8 to 2.3 one-row products on the same CPU, so a record of the old build must go."""
    path = write_quantized_gguf(tmp_path / "q.gguf")
    _llm(path)
    monkeypatch.setattr(row_cost, "builds_key", lambda: "another build")
    _llm(path)
    assert len(list(records.glob("*.json"))) == 2
