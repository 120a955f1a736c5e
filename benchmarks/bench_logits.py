"""How far each of eyas's matmul precisions, and llama.cpp at its defaults, keep the logits from HF transformers in
float32 on the same weights: the measurement behind ``matmul_precision="auto"``'s choice of "low" (int8
activations, llama.cpp's own arithmetic on a 4-bit GGUF), which it may take only where eyas's logits stay at least
as close to float32 as llama.cpp's.

The default GGUF model's dequantized folder (eyas's GGUF conversion) runs in HF transformers in float32 (the
reference) and bfloat16 (a yardstick); eyas runs the GGUF at "highest", "medium" (where the CPU has AVX512-BF16) and
"low"; llama.cpp (llama-cpp-python in its venv, ``benchmarks/setup_llama_cpp.sh``) runs the same GGUF with
``logits_all``. All see the same token ids (chat prompts, ``--tokens`` of them, one sequence) and print the mean,
root-mean-square and largest |logit - reference| over every position and vocabulary entry, and how often the top
token agrees with the reference's.

    python benchmarks/bench_logits.py [--tokens 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from bench_common import cpu_line

from eyas import LLM
from eyas.data.prompts import chat_prompts
from eyas.model import quantized as Q

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def llama_cpp_logits(gguf: Path, tokens: list[int], threads: int) -> torch.Tensor | None:
    from bench_cpu import LLAMA_VENV, run_peer

    if not (LLAMA_VENV / "bin" / "python").exists():
        print(f"llama.cpp: no venv at {LLAMA_VENV} (bash benchmarks/setup_llama_cpp.sh)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        prompts, out = Path(tmp) / "prompts.json", Path(tmp) / "logits.npy"
        prompts.write_text(json.dumps([tokens]))
        found = run_peer([str(LLAMA_VENV / "bin" / "python"), str(HERE / "peer_llama_cpp.py"), "--model", str(gguf),
                          "--prompts", str(prompts), "--threads", str(threads), "--logits-out", str(out)])
        if not found:
            return None
        print(f"  llama.cpp {found[0]['version']}: {found[0]['system_info']}")
        return torch.from_numpy(np.load(out))


def main(argv=None) -> int:
    import transformers
    from test_model_vs_hf import _eyas_logits_by_chunks

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    common = dict(quantization="gguf", max_model_len=args.tokens + 64, kv_cache_gb=0.05, max_num_batched_tokens=64)
    first = LLM(None, matmul_precision="highest", **common)
    config = first.engine.config.model
    tok = first.get_tokenizer()
    tokens = [t for c in chat_prompts(16) for t in tok.encode(tok.apply_chat_template(c), add_special_tokens=False)]
    tokens = tokens[:args.tokens]
    hf = transformers.AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        rows = {"HF bfloat16": hf.to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()}
    for precision in ("highest", "medium", "low"):
        if Q.kernel_available(precision):
            llm = first if precision == "highest" else LLM(None, matmul_precision=precision, **common)
            rows[f"eyas {precision}"] = _eyas_logits_by_chunks(llm, tokens)
    peer = llama_cpp_logits(Path(config.gguf_path), tokens, args.threads)
    if peer is not None:
        rows["llama.cpp default"] = peer
    print(f"{len(tokens)} positions of {config.path.name}; |logits - HF float32|:")
    print(f"{'':<20}{'mean':>8}{'rms':>8}{'max':>8}{'same top-1':>12}")
    for name, got in rows.items():
        err = (got - ref).abs()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean()
        print(f"{name:<20}{err.mean():8.4f}{err.pow(2).mean().sqrt():8.4f}{err.max():8.3f}{agree:12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
