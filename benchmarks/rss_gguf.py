"""Resident memory of the default model's weights in each weight format, against the GGUF file's size.

    python benchmarks/rss_gguf.py gguf      # or int8, none; gguf@highest etc. for a matmul precision

The process's resident set is read before the LLM is made (after PyTorch's own lazy start-up, which
pages in tens of MB of library code on the first module built, whatever the format) and after one
short generation, with freed heap handed back (malloc_trim); the KV cache's size is subtracted.
"""

import ctypes
import gc
import sys

import torch
from bench_common import weight_mode

from eyas import LLM, SamplingParams
from eyas.model.resolve import default_gguf_path


def rss_mib() -> float:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "gguf"
    with torch.device("meta"):
        torch.nn.Embedding(8, 8)  # PyTorch's lazy start-up, paid by any model
    kv_gb = 0.05
    before = rss_mib()
    llm = LLM(**weight_mode(mode), kv_cache_gb=kv_gb, max_model_len=512)
    llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    grown = rss_mib() - before - kv_gb * 1024
    size = default_gguf_path().stat().st_size / 2**20
    print(f"{mode}: resident growth {grown:.0f} MiB without the {kv_gb * 1024:.0f} MiB KV cache; "
          f"GGUF file {size:.0f} MiB; ratio {grown / size:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
