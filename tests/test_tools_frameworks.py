"""Agent frameworks nobody here wrote, end to end against ``eyas serve`` on the real default model:
pydantic-ai's default structured output (``output_type=``, sent as a tool the model must call) and
langchain-openai's ``bind_tools``. Both are in the test extra; a test is skipped where its package is not
installed (eyas installed as a library without the extra)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from server_helpers import Server

pytestmark = pytest.mark.slow


class City(BaseModel):
    city: str
    country: str


@pytest.fixture(scope="module")
def server():
    with Server("smollm2", "--max-model-len", "1024", "--kv-cache-gb", "0.1", "--served-model-name", "smol") as s:
        yield s


def test_pydantic_ai_output_type(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("smol", provider=OpenAIProvider(base_url=server.base + "/v1", api_key="none"))
    agent = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 80})
    result = agent.run_sync("Which city is the Eiffel Tower in?")
    assert isinstance(result.output, City) and result.output.city


def test_langchain_bind_tools(server):
    pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    llm = ChatOpenAI(model="smol", base_url=server.base + "/v1", api_key="none", temperature=0, max_tokens=80)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    structured = llm.with_structured_output(City, method="function_calling").invoke("Where is the Colosseum?")
    assert isinstance(structured, City)
