"""The eyas command: --help everywhere, generate streams text, bench prints throughput, errors are clean."""

import pytest

from eyas.cli import main


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["bench"], ["extract"]])
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
