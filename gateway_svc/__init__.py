"""gateway_svc: the HTTP front door (OpenAI- and Anthropic-compatible APIs, the chat page), calling
the router's `moemesh.v1.Generation` over gRPC."""
