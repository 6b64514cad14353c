"""Model adapters: the boundary between the loop and a provider's wire format.

``OpenAIChatAdapter`` speaks OpenAI-compatible chat completions (OpenAI, DeepSeek, vLLM,
llama.cpp's server, Ollama); ``OpenAIResponsesAdapter`` speaks OpenAI's Responses API;
``AnthropicAdapter`` speaks the Messages API. Other providers
subclass ``ModelAdapter``; an object that only has a ``stream(request)`` method returning an
async iterator of parts is accepted too. ``RetryPolicy`` is what a provider registration
may carry to ``agent/request-error`` for the retry plugin.
"""

from .._errors import ProviderError as ProviderError
from .._model import Finish as Finish
from .._model import LLMRequest as LLMRequest
from .._model import ReasoningDelta as ReasoningDelta
from .._model import TextDelta as TextDelta
from .._model import ToolCallDelta as ToolCallDelta
from ._anthropic import AnthropicAdapter as AnthropicAdapter
from ._base import AdapterDefaults as AdapterDefaults
from ._base import ModelAdapter as ModelAdapter
from ._openai import OpenAIChatAdapter as OpenAIChatAdapter
from ._responses import OpenAIResponsesAdapter as OpenAIResponsesAdapter
from ._retry import RetryPolicy as RetryPolicy
from ._retry import is_retryable as is_retryable

__all__ = [
    "OpenAIChatAdapter",
    "OpenAIResponsesAdapter",
    "AnthropicAdapter",
    "ModelAdapter",
    "AdapterDefaults",
    "LLMRequest",
    "TextDelta",
    "ReasoningDelta",
    "ToolCallDelta",
    "Finish",
    "ProviderError",
    "RetryPolicy",
    "is_retryable",
]
