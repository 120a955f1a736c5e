"""Does the built-in model loop? Its answers to a few everyday chat prompts under candidate sampling
defaults: how many loop (a 4-word sequence said 3 times or more) and how many run to max_tokens.

This is how eyas chose the built-in model's defaults (eyas.sampling.defaults.BUILT_IN_SAMPLING): the
model card's temperature 0.2 and top_p 0.9, plus the mildest repetition penalty that stops loops.

    python benchmarks/first_impressions.py [--seeds 4] [--penalties 1.0,1.05,1.1,1.2]
"""

from __future__ import annotations

import argparse
from collections import Counter

from eyas import LLM, SamplingParams

PROMPTS = ["Write a haiku about falcons.", "What is the capital of France?", "Explain photosynthesis in two sentences.",
           "Give me three tips for learning to code."]


def loops(text: str) -> bool:
    words = text.split()
    if len(words) < 12:
        return False
    return Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3)).most_common(1)[0][1] >= 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--penalties", default="1.0,1.05,1.1,1.2")
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    llm = LLM(max_model_len=2048)
    conversations = [[{"role": "user", "content": q}] for q in PROMPTS]
    for penalty in (float(x) for x in args.penalties.split(",")):
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, repetition_penalty=penalty, seed=s,
                                 max_tokens=args.max_tokens) for s in range(args.seeds)]
        outs = llm.chat([c for c in conversations for _ in params], [q for _ in conversations for q in params],
                        use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        looping = sum(loops(t) for t in texts)
        capped = sum(o.outputs[0].finish_reason == "length" for o in outs)
        print(f"temperature {args.temperature} top_p {args.top_p} repetition_penalty {penalty}: "
              f"{looping}/{len(texts)} loop, {capped}/{len(texts)} reach max_tokens; e.g. {texts[0][:90]!r}")


if __name__ == "__main__":
    main()
