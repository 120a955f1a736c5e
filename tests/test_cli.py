"""The eyas command: --help everywhere, generate streams text, bench prints throughput, errors are clean."""

import json

import pytest

from eyas.cli import main


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["bench"], ["extract"], ["regenerate"], ["train"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(command + ["--help"])
    assert exit_info.value.code == 0
    assert "usage: eyas" in capsys.readouterr().out


def test_generate_streams_and_reports(tiny_models, capsys):
    code = main(["generate", "hello there", "--model", str(tiny_models["llama"]), "--max-tokens", "6",
                 "--kv-cache-gb", "0.01", "--max-model-len", "128", "--spec-method", "ngram", "--spec-tokens", "2"])
    captured = capsys.readouterr()
    assert code == 0
    assert "[6 tokens, finish=length" in captured.err


def test_generate_with_hidden_state_extraction_names_the_file(tiny_models, tmp_path, capsys):
    code = main(["generate", "hello there", "--model", str(tiny_models["llama"]), "--max-tokens", "3",
                 "--kv-cache-gb", "0.01", "--max-model-len", "128", "--spec-method", "extract_hidden_states",
                 "--spec-tokens", "1", "--spec-aux-layer-ids", "1,3", "--spec-output-dir", str(tmp_path),
                 "--spec-include-output"])
    assert code == 0
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and f"[hidden states: {files[0]}]" in capsys.readouterr().err


def test_generate_with_suffix_decoding_keeps_its_cache_file(tiny_models, tmp_path, capsys):
    from eyas.spec_decode.suffix import load_outputs

    cache = tmp_path / "suffix.cache"
    args = ["generate", "hello there", "--model", str(tiny_models["llama"]), "--max-tokens", "6", "--kv-cache-gb", "0.01",
            "--max-model-len", "128", "--spec-method", "suffix", "--suffix-max-tree-depth", "8", "--suffix-cache", str(cache)]
    assert main(args) == 0 and [len(o) for o in load_outputs(str(cache), 320)] == [6]  # saved when the command ends
    assert main(args) == 0 and [len(o) for o in load_outputs(str(cache), 320)] == [6, 6]  # loaded, then one more
    assert main(args + ["--suffix-min-token-prob", "2"]) == 2
    assert "suffix_decoding_min_token_prob: 2.0 must be a number in [0, 1]" in capsys.readouterr().err


def test_generate_with_suffix_decoding_in_front_of_a_drafter(drafters, tmp_path, capsys):
    from eyas.spec_decode.suffix import load_outputs

    cache = tmp_path / "suffix.cache"
    args = ["generate", "hello there", "--model", str(drafters.target), "--max-tokens", "6", "--kv-cache-gb", "0.01",
            "--max-model-len", "128", "--spec-method", "eagle3", "--spec-model", drafters.folders["eagle3"],
            "--spec-tokens", "2", "--spec-suffix", "--suffix-cache", str(cache)]
    assert main(args) == 0 and [len(o) for o in load_outputs(str(cache), 320)] == [6]  # the suffix part ran and saved
    assert main(["generate", "hi", "--model", str(drafters.target), "--kv-cache-gb", "0.01", "--max-model-len", "128",
                 "--spec-method", "ngram", "--spec-suffix"]) == 2
    assert "enable_suffix_decoding: not used by method 'ngram'" in capsys.readouterr().err


def test_generate_batch_and_bench(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    model = ["--model", str(tiny_models["qwen2"]), "--kv-cache-gb", "0.01", "--max-model-len", "1024"]
    assert main(["generate", "--prompts-file", str(prompts), "--max-tokens", "4", *model]) == 0
    assert capsys.readouterr().out.count("### ") == 3
    assert main(["bench", "--num-prompts", "3", "--max-tokens", "4", *model]) == 0
    assert "output throughput" in capsys.readouterr().out


def test_bad_flag_value_is_a_clean_error(tiny_models, capsys):
    code = main(["generate", "hi", "--model", str(tiny_models["llama"]), "--temperature", "-1",
                 "--kv-cache-gb", "0.01", "--max-model-len", "128"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err


def test_sampling_defaults_come_from_generation_config_then_the_api(tiny_models, tmp_path):
    import shutil

    from eyas import LLM
    from eyas.cli import _params, build_parser
    from eyas.sampling.defaults import BUILT_IN_SAMPLING, sampling_defaults

    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    assert LLM(str(folder), max_model_len=64, kv_cache_gb=0.01).get_default_sampling_params().temperature == 1.0
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 258, "temperature": 0.3, "top_k": 20,
                                                               "do_sample": True}))
    llm = LLM(str(folder), max_model_len=64, kv_cache_gb=0.01)
    assert llm.sampling_defaults == {"temperature": 0.3, "top_k": 20}
    params = _params(llm, build_parser().parse_args(["generate", "hi"]))
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 20, 1.0)
    params = _params(llm, build_parser().parse_args(["generate", "hi", "--temperature", "0", "--top-p", "0.5"]))
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 0.5)
    assert sampling_defaults(None, folder) == {**BUILT_IN_SAMPLING, "temperature": 0.3, "top_k": 20}
    assert sampling_defaults("smollm2", tmp_path) == BUILT_IN_SAMPLING == {"temperature": 0.2, "top_p": 0.9,
                                                                           "repetition_penalty": 1.1}


def test_generate_with_a_json_schema_file(tiny_models, tmp_path, capsys):
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["id"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    model = ["--model", str(tiny_models["llama"]), "--kv-cache-gb", "0.01", "--max-model-len", "128", "--quiet",
             "--temperature", "0"]
    assert main(["generate", "hello", "--json-schema", str(tmp_path / "schema.json"), *model]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert set(answer) == {"id"} and 0 <= answer["id"] <= 50
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["generate", "hello", "--json-schema", str(tmp_path / "bad.json"), *model]) == 2
    assert "--json-schema: cannot read a JSON schema from" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["extract", "regenerate"])
def test_data_jobs_pass_every_engine_flag(command, tiny_models, tmp_path, monkeypatch):
    """The engine flags of `eyas extract` / `eyas regenerate` reach the LLM (--quantization was once dropped)."""
    from eyas import llm as llm_module

    seen = {}
    real = llm_module.LLM.__init__

    def spy(self, model=None, **kwargs):
        seen.update(kwargs)
        real(self, model, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", spy)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    out = tmp_path / ("regen.jsonl" if command == "regenerate" else "dumps")
    extra = ["--max-tokens", "2"] if command == "regenerate" else []
    assert main([command, "--data", str(data), "--out", str(out), "--model", str(tiny_models["llama"]),
                 "--quantization", "none", "--max-num-seqs", "3", "--kv-cache-gb", "0.02", "--threads", "1",
                 "--no-prefix-caching", *extra]) == 0
    assert seen["quantization"] is None and seen["max_num_seqs"] == 3 and seen["num_threads"] == 1
    assert seen["enable_prefix_caching"] is False and seen["kv_cache_gb"] == 0.02
