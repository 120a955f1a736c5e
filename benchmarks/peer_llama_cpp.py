"""Peer benchmark: llama.cpp (llama-cpp-python, compiled from PyPI) on the same GGUF and token ids as eyas.

Runs INSIDE the venv made by ``benchmarks/setup_llama_cpp.sh``; it does not import eyas.

    /opt/llama-cpp-venv/bin/python benchmarks/peer_llama_cpp.py --model FILE.gguf --prompts prompts.json \\
        --threads 1 --max-tokens 128 [--prompt-lookup]

Each prompt (a chat-templated token-id list) is run on its own, greedily (top_k=1), for exactly
``--max-tokens`` new tokens (EOS does not stop it, as eyas's ``ignore_eos``); the time of each
run, prefill included, is summed. llama-cpp-python has no batched generation API, so this is
batch 1 only. The same prompts are then run to their first token only, and that time is reported too
(``first_token_seconds``: the prefill's share). ``--prompt-lookup`` adds llama-cpp-python's prompt-lookup drafter
(``LlamaPromptLookupDecoding``) at its defaults. One JSON object goes to stdout, with tokens/s and
the greedy token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the .gguf file")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4, help="how many of the prompts to run (one at a time)")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--prompt-lookup", action="store_true", help="LlamaPromptLookupDecoding at its defaults")
    p.add_argument("--logits-out", help="instead of timing: the logits at every position of the first prompt "
                   "(logits_all), saved as a float32 .npy [tokens, vocab]")
    args = p.parse_args(argv)
    with open(args.prompts, encoding="utf-8") as f:
        prompts = json.load(f)[: args.num_prompts]

    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if args.logits_out:
        import numpy as np

        llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                              n_threads_batch=args.threads, logits_all=True, verbose=False)
        llm.eval(prompts[0])
        np.save(args.logits_out, np.asarray(llm.scores[:len(prompts[0])], dtype=np.float32))
        print(json.dumps({"engine": "llama.cpp", "version": llama_cpp.__version__, "tokens": len(prompts[0]),
                          "system_info": llama_cpp.llama_print_system_info().decode().strip()}), flush=True)
        return 0

    llm = llama_cpp.Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False,
                          draft_model=LlamaPromptLookupDecoding() if args.prompt_lookup else None)

    def run(tokens: list[int], count: int) -> list[int]:
        out = []
        for token in llm.generate(tokens, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == count:
                break
        return out

    run(prompts[0], 8)  # warm-up
    seconds, token_ids = 0.0, []
    for tokens in prompts:
        start = time.perf_counter()
        token_ids.append(run(tokens, args.max_tokens))
        seconds += time.perf_counter() - start
    first = 0.0  # the same prompts to their first token only: the prefill's share of the time above
    for tokens in prompts:
        start = time.perf_counter()
        run(tokens, 1)
        first += time.perf_counter() - start
    n_out = sum(map(len, token_ids))
    print(json.dumps({
        "engine": "llama.cpp", "version": llama_cpp.__version__, "threads": args.threads,
        "prompt_lookup": args.prompt_lookup, "num_prompts": len(prompts), "output_tokens": n_out,
        "seconds": round(seconds, 4), "tokens_per_s": round(n_out / seconds, 3),
        "first_token_seconds": round(first, 4),
        "system_info": llama_cpp.llama_print_system_info().decode().strip(), "token_ids": token_ids,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
