"""Which verification mode accepts more drafts at temperature 0.7 on real chat prompts?

Runs the same seeded requests with ``verification="shared_noise"`` and ``"rejection"`` for a
draft-model drafter (self-speculation with the target's first layers, which samples its drafts)
and for the n-gram drafter (one-hot drafts), and prints acceptance rate and mean acceptance
length side by side. Both modes are lossless; this only decides the default.
"""

import argparse
import time

import torch

from eyas import LLM, SamplingParams
from eyas.data.prompts import chat_prompts, copy_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--draft-layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = {
        f"draft_model (first {args.draft_layers} layers)":
            {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": args.draft_layers},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    }
    print(f"temperature {args.temperature}, {args.num_prompts} chat + {args.num_prompts} copy prompts, "
          f"{args.max_tokens} new tokens, seeds 0..n-1, adaptive draft length off")
    print(f"{'drafter':<32} {'mode':<13} {'accept rate':>11} {'accept len':>10} {'tok/s':>7}")
    for name, spec in configs.items():
        for mode in ("shared_noise", "rejection"):
            llm = LLM(None, dtype="float32", max_model_len=1024, enable_prefix_caching=False,
                      speculative_config={**spec, "verification": mode, "adaptive_draft_length": False})
            tok = llm.get_tokenizer()
            convs = chat_prompts(args.num_prompts) + copy_prompts(args.num_prompts)
            prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in convs]
            params = [SamplingParams(temperature=args.temperature, seed=i, max_tokens=args.max_tokens)
                      for i in range(len(prompts))]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            stats = llm.stats()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(f"{name:<32} {mode:<13} {stats['acceptance_rate']:>11.3f} {stats['mean_acceptance_length']:>10.2f} "
                  f"{tokens / elapsed:>7.1f}")


if __name__ == "__main__":
    main()
