"""eyas: a compact, hackable LLM inference engine built around speculative decoding."""

from eyas.engine.outputs import CompletionOutput, RequestOutput
from eyas.llm import LLM
from eyas.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
