"""GPU sanity benchmark: eyas vs HF generate on a random-init model of SmolLM2-135M's shape (bf16).

For machines without the default model package (e.g. a lent GPU box): builds the model with
transformers, saves it, and times greedy decoding of 128 tokens at batch 1, 8 and 32 in one run.
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eyas import LLM, SamplingParams  # noqa: E402


def random_smollm2_shape(folder: Path) -> Path:
    """A random-init Llama with SmolLM2-135M's shape and a word-level tokenizer, saved in ``folder``."""
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                   rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({str(i): i for i in range(49152)}, unk_token="0")).save(str(folder / "tokenizer.json"))
    return folder


def _eyas_tokens_per_s(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    folder = random_smollm2_shape(Path(tempfile.mkdtemp()) / "smollm2-shape")
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=1024)
    eager = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=1024, enforce_eager=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (200,), generator=g).tolist() for _ in range(32)]
    print(f"{torch.cuda.get_device_name()}, bf16, random weights of SmolLM2-135M's shape, 200-token prompts, 128 new;"
          f" eyas with CUDA graphs of the decode step and eager (enforce_eager)")
    print(f"{'B':>3} {'eyas tok/s':>11} {'eager tok/s':>12} {'HF tok/s':>9} {'eyas/HF':>8} {'eyas/eager':>11}")
    for batch in (1, 8, 32):
        eyas_tps = _eyas_tokens_per_s(llm, prompts[:batch], params)
        eager_tps = _eyas_tokens_per_s(eager, prompts[:batch], params)
        ids = torch.tensor(prompts[:batch], device="cuda")
        kw = dict(do_sample=False, max_new_tokens=128, min_new_tokens=128, pad_token_id=0)
        hf.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, **kw)
        torch.cuda.synchronize()
        hf_tps = batch * 128 / (time.perf_counter() - start)
        print(f"{batch:>3} {eyas_tps:>11.1f} {eager_tps:>12.1f} {hf_tps:>9.1f} {eyas_tps / hf_tps:>7.2f}x"
              f" {eyas_tps / eager_tps:>10.2f}x")


if __name__ == "__main__":
    main()
