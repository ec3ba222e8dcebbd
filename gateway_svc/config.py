"""`GatewayConfig`: every setting of the HTTP gateway (flags and env overrides derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.config import RpcConfig


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway: OpenAI- and Anthropic-compatible APIs and the chat page, in front of a router."""

    router: str = field(metadata={"help": "HOST:PORT of the router's Generation service"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "HTTP port to bind (0 = any free port)"})
    api_key: str = field(default="", metadata={"help": "when set, /v1/* requires it as `Authorization: Bearer KEY` or `x-api-key: KEY` (also read from MOEMESH_API_KEY)"})
    served_model_name: str = field(default="", metadata={"help": "the model name clients use (default: the name the router serves, the model directory's)"})
    control: str = field(default="", metadata={"help": "HOST:PORT of the control plane, for the chat page's live mesh view (optional)"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "deadline of one generation (504 after it)"})
    connect_timeout_s: float = field(default=60.0, metadata={"help": "how long to wait for the router at start"})
    max_body_mb: int = field(default=32, metadata={"help": "largest request body, MiB (413 beyond)"})
    reasoning_parser: str = field(default="think", metadata={"help": "split `<think>...</think>` at the start of the output into reasoning", "choices": ("think", "none")})
    tool_parser: str = field(default="hermes", metadata={"help": "parse `<tool_call>{json}</tool_call>` into tool calls when a request offers tools", "choices": ("hermes", "none")})
    rpc: RpcConfig = field(default_factory=RpcConfig)

    def __post_init__(self) -> None:
        if ":" not in self.router:
            raise ValueError(f"router must be HOST:PORT of the router, got {self.router!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.control and ":" not in self.control:
            raise ValueError(f"control must be HOST:PORT of the control plane, got {self.control!r}")
        for name in ("request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 1 <= self.max_body_mb <= 1024:
            raise ValueError(f"max_body_mb must be in [1, 1024], got {self.max_body_mb}")
