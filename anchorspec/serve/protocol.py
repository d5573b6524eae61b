"""Request validation for /v1/chat/completions and /v1/completions, and OpenAI-style errors.

Everything a request may carry is checked here, before the scheduler sees it, so a bad request
costs nothing and always ends in `{"error": {"message", "type", "param", "code"}}` with a 4xx.
Parameters the OpenAI API has but this server does not implement are refused (400) when set to
anything but their neutral value, rather than silently ignored; unknown extra fields are ignored,
as OpenAI-compatible servers usually do (clients send vendor fields such as `user`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error the client caused (or a server fault), rendered as OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# name -> values that mean "not used"; anything else is refused with 400
UNSUPPORTED = {
    "stop": (None, [], ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # without tools, "auto" means none
    "functions": (None, []),
    "function_call": (None, "none"),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)  # OpenAI's default: sampling at T=1 unless told otherwise
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


@dataclass
class Job:
    """A validated request, in the scheduler's terms."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    include_usage: bool


def parse(kind: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        req = kind.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    for name, neutral in UNSUPPORTED.items():
        if name in body and body[name] not in neutral:
            raise APIError(400, f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    if req.n != 1:
        raise APIError(400, f"only n=1 is supported, got n={req.n}", param="n", code="unsupported_parameter")
    return req


def check_model(req: BaseModel, served: str) -> None:
    if req.model != served:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


def message_dicts(req: ChatRequest) -> list[dict]:
    """Messages as plain {role, content} strings for the chat template (text parts only)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, "only text content parts are supported", param=f"messages.{i}.content")
                texts.append(part["text"])
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or ""})
    return out


def single_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids (batches are refused)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt",
                           code="unsupported_parameter")
        p = p[0]
    if len(p) == 0:
        raise APIError(400, "prompt is empty", param="prompt")
    return p


def make_job(req: _Sampling, prompt_ids: list[int], context: int, max_tokens_limit: int) -> Job:
    """Resolve max_tokens against the limit and the context window."""
    n = len(prompt_ids)
    room = context - n
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {context} tokens; the prompt has {n}",
                       param="messages" if isinstance(req, ChatRequest) else "prompt", code="context_length_exceeded")
    requested = getattr(req, "max_completion_tokens", None)
    if requested is None:
        requested = req.max_tokens
    if requested is None:
        requested = min(room, max_tokens_limit)
    if not 1 <= requested <= max_tokens_limit:
        raise APIError(400, f"max_tokens must be in 1..{max_tokens_limit}, got {requested}", param="max_tokens")
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {context} tokens; you requested "
                            f"{n + requested} ({n} in the prompt, {requested} for the completion)",
                       param="max_tokens", code="context_length_exceeded")
    opts = req.stream_options
    return Job(prompt_ids, requested, req.temperature, req.top_p, req.seed, req.stream,
               bool(opts and opts.include_usage))
