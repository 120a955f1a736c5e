"""``n`` samples of one prompt (``SamplingParams.n``): one parent request fanned out into n children.

Child i is an ordinary request with id ``"{parent}#{i}"``, ``n = 1`` and, when the parent has a seed,
seed ``seed + i`` (vLLM's rule), so child i samples exactly what a single request with that seed
would. Child 0 is scheduled at once; the others are held until child 0's prompt is in the KV cache
(its first token), then find the prompt's full blocks there through prefix caching instead of
computing them again.

The parent's output gathers its children's latest outputs, ``outputs[i].index == i``; it is finished
when every child is. Example, n = 2: child 0 emits "Hi" -> parent outputs ["Hi", ""]; child 1
emits "Yo" and finishes -> ["Hi", "Yo"], not finished; child 0 finishes -> finished.
"""

from __future__ import annotations

import dataclasses

from eyas.core.metrics import SpecStats
from eyas.core.request import Request
from eyas.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def child_seeds(seed: int | None, n: int, draw) -> list[int]:
    """The children's seeds: ``seed + i`` for a seeded parent, else one fresh ``draw()`` each."""
    return [seed + i for i in range(n)] if seed is not None else [draw() for _ in range(n)]


class ParentRequest:
    def __init__(self, request_id: str, children: list[Request], prompt: str | None, stream: bool = True):
        self.request_id = request_id
        self.children = children  # [n], child i at index i
        self.prompt = prompt
        self.stream = stream  # its children's outputs are read before they end
        self.held = children[1:]  # not yet handed to the scheduler
        self.latest: list[RequestOutput | None] = [None] * len(children)

    @staticmethod
    def child_id(request_id: str, index: int) -> str:
        return f"{request_id}#{index}"

    def index_of(self, child_id: str) -> int:
        return int(child_id.rsplit("#", 1)[1])

    def release(self) -> list[Request]:
        """The held children, once child 0's prompt is cached (it has emitted a token)."""
        held, self.held = self.held, []
        return held

    def merge(self, output: RequestOutput) -> RequestOutput:
        """Record one child's output; the parent's output with every child's latest."""
        index = self.index_of(output.request_id)
        self.latest[index] = output
        return self.output()

    def output(self) -> RequestOutput:
        outputs = []
        for i, latest in enumerate(self.latest):
            if latest is None:  # not started: an empty completion
                outputs.append(CompletionOutput(i, "", []))
            else:
                outputs.append(dataclasses.replace(latest.outputs[0], index=i))
        finished = all(o is not None and o.finished for o in self.latest)
        stats = SpecStats()
        for child in self.children:
            stats.merge(child.spec_stats)
        firsts = [c.first_token_time for c in self.children if c.first_token_time is not None]
        metrics = RequestMetrics(min(c.arrival_time for c in self.children), min(firsts) if firsts else None,
                                 max(c.finish_time for c in self.children) if finished else None,
                                 sum(c.num_output_tokens for c in self.children))
        first = self.children[0]
        return RequestOutput(self.request_id, self.prompt, first.prompt_token_ids, outputs, finished, metrics,
                             max(c.num_cached_tokens for c in self.children), stats.as_dict(),
                             prompt_logprobs=self.latest[0].prompt_logprobs if self.latest[0] is not None else None)
