"""eyas's suffix trees vs ArcticInference's suffix cache, drafting on the same token streams.

Two steps, two Python environments (``arctic-inference`` builds its C++ suffix tree from source; it
needs no GPU, but keep it out of the project's environment):

    python benchmarks/compare_arctic.py record /tmp/streams.json        # eyas, no speculation: the streams
    python3 -m venv /tmp/arctic-venv && /tmp/arctic-venv/bin/pip install arctic-inference numpy
    /tmp/arctic-venv/bin/python benchmarks/compare_arctic.py compare /tmp/streams.json

``record`` generates the benchmark's code workload (``bench_spec.py``: the tasks of ``code_tasks.json``,
each asked ``--seeds`` times in rounds, temperature 0.2, top_p 0.95) and writes every request's prompt
and output token ids in order. ``compare`` replays them one request at a time, as B = 1 decoding
with every draft verified: a step proposes a draft for the tokens so far, accepts the longest prefix
that equals the recorded continuation (exactly what shared-noise verification accepts), and appends
the accepted tokens plus one. Drafters, all with depth 24, k 12, factor 1, min token prob 0.1:

* ``eyas``: ``eyas.spec_decode.suffix_tree`` (loaded from its file, no torch needed), the request's own tree
  plus a global tree of the outputs of the requests before it, as ``SuffixProposer`` does;
* ``arctic, same trees``: ArcticInference's C++ ``SuffixTree`` in the same two roles, so only the trees
  and their speculation differ (ties: eyas takes the most recent continuation, Arctic its hash map's
  first; Arctic's probabilities are float32);
* ``arctic cache``: ``SuffixDecodingCache`` as vLLM drives it (the global tree also gets every live
  response as it grows, the current request's own included).

Prints tokens per step of each (every draft verified, no cost model) and, on the contexts of eyas's
own replay, how often the two tree implementations propose the same draft and the same score.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPTH, K, FACTOR, MIN_PROB = 24, 12, 1.0, 0.1


def record(args) -> None:
    from bench_spec import CODE_INSTRUCTION, CODE_TASKS, render

    from eyas import LLM, SamplingParams

    llm = LLM(args.model, dtype="float32", num_threads=args.threads, enable_prefix_caching=False)
    tasks = json.loads(CODE_TASKS.read_text())
    stubs = render(llm, [[{"role": "user", "content": CODE_INSTRUCTION.format(t["prompt"])}] for t in tasks])
    rounds = [(t, seed) for seed in range(args.seeds) for t in range(len(tasks))]
    params = [SamplingParams(temperature=0.2, top_p=0.95, seed=seed, max_tokens=args.max_tokens) for _, seed in rounds]
    outs = llm.generate([stubs[t] for t, _ in rounds], params, use_tqdm=False)
    streams = [{"prompt": stubs[t], "output": o.outputs[0].token_ids} for (t, _), o in zip(rounds, outs)]
    Path(args.streams).write_text(json.dumps(streams))
    print(f"{len(streams)} requests, {sum(len(s['output']) for s in streams)} output tokens -> {args.streams}")


def _eyas_tree():
    spec = importlib.util.spec_from_file_location("suffix_tree", HERE.parent / "eyas" / "spec" / "suffix_tree.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["suffix_tree"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class EyasDrafter:
    def __init__(self, st):
        self.st, self.cache = st, st.SuffixTree(DEPTH)

    def start(self, prompt):
        self.own = self.st.SuffixTree(DEPTH).writer()
        self.own.extend(prompt)

    def add(self, tokens):
        self.own.extend(tokens)

    def draft(self):
        own = self.st.best_draft(self.own.matches(), DEPTH, K, FACTOR, MIN_PROB)
        other = self.st.best_draft(self.cache.matches(self.own.tokens[-DEPTH:]), DEPTH, K, FACTOR, MIN_PROB,
                                   beat=own.score if own else 0.0)
        best = other or own
        return (best.tokens, best.score) if best else ([], 0.0)

    def end(self, output):
        self.cache.writer().extend(output)


class ArcticTrees:
    """Arctic's C++ tree in eyas's roles: the request's own tree, and a global tree of ended outputs."""

    def __init__(self, tree_class):
        self.tree_class, self.cache, self.num_cached = tree_class, tree_class(DEPTH), 0

    def start(self, prompt):
        self.own, self.tokens = self.tree_class(DEPTH), list(prompt)
        self.own.extend(0, prompt)

    def add(self, tokens):
        self.own.extend(0, tokens)
        self.tokens += tokens

    def draft(self):
        context = self.tokens[-DEPTH:]
        own = self.own.speculate(context, K, FACTOR, 0.0, MIN_PROB, False)
        other = self.cache.speculate(context, K, FACTOR, 0.0, MIN_PROB, False)
        best = other if other.score > own.score else own
        return list(best.token_ids), best.score

    def end(self, output):
        self.cache.extend(self.num_cached, output)
        self.num_cached += 1


class ArcticCache:
    """``SuffixDecodingCache`` driven as vLLM's proposer drives it."""

    def __init__(self, cache_class):
        self.cache, self.n = cache_class(max_tree_depth=DEPTH, max_cached_requests=10000), 0

    def start(self, prompt):
        self.n += 1
        self.cache.start_request(self.n, prompt)
        self.tokens = list(prompt)

    def add(self, tokens):
        self.cache.add_active_response(self.n, tokens)
        self.tokens += tokens

    def draft(self):
        d = self.cache.speculate(self.n, self.tokens[-DEPTH:], max_spec_tokens=K, max_spec_factor=FACTOR,
                                 min_token_prob=MIN_PROB)
        return list(d.token_ids), d.score

    def end(self, output):
        self.cache.stop_request(self.n)


def replay(streams, drafter, others=()) -> tuple[float, list[tuple[int, int]]]:
    """Tokens per step of ``drafter``; for each of ``others`` (fed the same tokens), how many of its drafts on
    the same contexts equal ``drafter``'s, and how many have the same score (to 1e-5)."""
    steps = tokens = 0
    agree = [[0, 0] for _ in others]
    for s in streams:
        for d in (drafter, *others):
            d.start(s["prompt"])
        out, pos = s["output"], 0
        while pos < len(out):
            draft, score = drafter.draft()
            for counts, other in zip(agree, others):
                other_draft, other_score = other.draft()
                counts[0] += other_draft == draft
                counts[1] += abs(other_score - score) < 1e-5
            accepted = 0
            while accepted < len(draft) and pos + accepted < len(out) and draft[accepted] == out[pos + accepted]:
                accepted += 1
            emitted = out[pos:pos + accepted + 1]
            for d in (drafter, *others):
                d.add(emitted)
            pos += len(emitted)
            steps += 1
            tokens += len(emitted)
        for d in (drafter, *others):
            d.end(out)
    return tokens / steps, [(a, b) for a, b in agree], steps


def compare(args) -> None:
    from arctic_inference.suffix_decoding import SuffixDecodingCache
    from arctic_inference.suffix_decoding._C import SuffixTree

    streams = json.loads(Path(args.streams).read_text())
    st = _eyas_tree()
    print(f"{len(streams)} requests, {sum(len(s['output']) for s in streams)} output tokens; depth {DEPTH}, k {K}, "
          f"factor {FACTOR}, min token prob {MIN_PROB}; every draft verified")
    eyas_rate, ((same, same_score),), steps = replay(streams, EyasDrafter(st), [ArcticTrees(SuffixTree)])
    print(f"eyas                 {eyas_rate:.3f} tokens/step")
    print(f"  arctic, same trees, on eyas's {steps} contexts: same draft {same / steps:.1%}, same score "
          f"{same_score / steps:.1%}")
    for name, drafter in (("arctic, same trees", ArcticTrees(SuffixTree)), ("arctic cache (vLLM)", ArcticCache(
            SuffixDecodingCache))):
        print(f"{name:<20} {replay(streams, drafter)[0]:.3f} tokens/step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="generate the code workload with eyas and write its token streams")
    r.add_argument("streams")
    r.add_argument("--model", default=None)
    r.add_argument("--seeds", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=1)
    c = sub.add_parser("compare", help="replay the streams with eyas's and ArcticInference's suffix trees")
    c.add_argument("streams")
    args = p.parse_args()
    record(args) if args.command == "record" else compare(args)


if __name__ == "__main__":
    main()
