"""Who may call the mesh's gRPC services: the mesh token, mTLS and the public API key.

- **Mesh token** (internal services: control plane, expert servers, attention replicas): every call
  but the health checks carries `x-moemesh-token: TOKEN`; the server compares it in constant time
  and answers UNAUTHENTICATED otherwise. A service refuses to start without a token unless it is
  told `--insecure-no-auth`. The token comes from `--mesh-token-file` or `MOEMESH_MESH_TOKEN`
  (never a command-line value: argv is visible to every local user).
- **mTLS** (`--tls-cert`, `--tls-key`, `--tls-ca`, all three or none): servers serve TLS and require
  a client certificate the CA signed; channels verify the server against the CA and present their
  own certificate. `--tls-server-name` names what the peers' certificates carry when it is not the
  dialed host (one certificate for the whole mesh, dialed by pod IP).
- **API key** (the router's public API, optional): `authorization: Bearer KEY`.

Clients (services calling each other, `moemesh ctl`/`generate`, the HTTP gateway) get all of this
from `moemesh.rpc.server.make_channel(address, rpc, api_key)`.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import grpc

TOKEN_HEADER = "x-moemesh-token"
API_KEY_HEADER = "authorization"  # value "Bearer KEY"
MIN_SECRET_CHARS = 16
# Open to anyone: kubelet and load-balancer probes carry no credentials.
OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


@dataclass(frozen=True)
class SecurityConfig:
    mesh_token_file: str | None = field(default=None, metadata={
        "help": "file holding the mesh token every internal call carries (moemesh up makes one)", "metavar": "FILE"})
    mesh_token: str = field(default="", repr=False, metadata={
        "secret": True, "env": "MOEMESH_MESH_TOKEN", "help": "the mesh token itself (environment only, never a flag)"})
    insecure_no_auth: bool = field(default=False, metadata={
        "help": "serve and call without the mesh token: anyone who reaches the port can steer the mesh (trusted networks only)"})
    tls_cert: str | None = field(default=None, metadata={"help": "PEM certificate this process presents (with --tls-key and --tls-ca: mTLS)", "metavar": "FILE"})
    tls_key: str | None = field(default=None, metadata={"help": "PEM private key of --tls-cert", "metavar": "FILE"})
    tls_ca: str | None = field(default=None, metadata={"help": "PEM CA bundle peers' certificates must chain to", "metavar": "FILE"})
    tls_server_name: str | None = field(default=None, metadata={
        "help": "name the servers' certificates carry when it is not the dialed host (e.g. one certificate for the whole mesh)"})

    def __post_init__(self) -> None:
        if self.mesh_token and self.mesh_token_file:
            raise ValueError("mesh_token_file: give the mesh token once (MOEMESH_MESH_TOKEN is set too)")
        if self.insecure_no_auth and (self.mesh_token or self.mesh_token_file):
            raise ValueError("insecure_no_auth: contradicts the mesh token that is given")
        if self.mesh_token:
            check_secret("mesh_token", self.mesh_token)
        if self.mesh_token_file:
            check_secret("mesh_token_file", read_secret(self.mesh_token_file, "mesh_token_file"))
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        given = [k for k, v in tls.items() if v]
        if given and len(given) != 3:
            missing = sorted(set(tls) - set(given))
            raise ValueError(f"{missing[0]}: mTLS needs tls_cert, tls_key and tls_ca together (given: {', '.join(given)})")
        for name, path in tls.items():
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def token(self) -> str:
        """The mesh token ("" when none is configured)."""
        if self.mesh_token_file:
            return read_secret(self.mesh_token_file, "mesh_token_file")
        return self.mesh_token

    def require_token(self) -> None:
        """ValueError unless a mesh token is configured or `insecure_no_auth` says to run without one
        (every service calls this: a service never serves its internal API open by accident)."""
        if not (self.mesh_token or self.mesh_token_file or self.insecure_no_auth):
            raise ValueError(
                "mesh_token_file: no mesh token: give --mesh-token-file FILE or MOEMESH_MESH_TOKEN (moemesh up makes one "
                "for its services), or --insecure-no-auth to run without authentication")

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS requiring a client certificate the CA signed; None without TLS."""
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(self._read(self.tls_key), self._read(self.tls_cert))], root_certificates=self._read(self.tls_ca), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS verifying the server against the CA and presenting this process's certificate; None without TLS."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(self._read(self.tls_ca), self._read(self.tls_key), self._read(self.tls_cert))

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls and self.tls_server_name else []

    def call_metadata(self, api_key: str = "") -> tuple[tuple[str, str], ...]:
        """What every call of a channel carries: the mesh token (when configured), the API key (when given)."""
        md = []
        token = self.token()
        if token:
            md.append((TOKEN_HEADER, token))
        if api_key:
            md.append((API_KEY_HEADER, f"Bearer {api_key}"))
        return tuple(md)


def read_secret(path: str, name: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {path!r}: {e.strerror or e}") from None


def check_secret(name: str, value: str) -> None:
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"{name}: a secret of at least {MIN_SECRET_CHARS} characters is required, got {len(value)}")


# ---- servers -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credential:
    """What a server requires of every call (but OPEN_METHODS): metadata `header` holding `secret`
    (after `scheme`, e.g. "Bearer "). An empty secret requires nothing."""

    header: str
    secret: str
    scheme: str = ""
    what: str = "mesh token"

    def presented(self, metadata) -> str:
        """The credential a call carries ("" when none)."""
        for key, value in metadata or ():
            if key == self.header:
                value = value.decode(errors="replace") if isinstance(value, bytes) else value
                if self.scheme:
                    if value[:len(self.scheme)].lower() != self.scheme.lower():
                        return ""
                    value = value[len(self.scheme):]
                return value.strip()
        return ""

    def accepts(self, metadata) -> bool:
        return not self.secret or hmac.compare_digest(self.presented(metadata).encode(), self.secret.encode())


def mesh_token_credential(sec: SecurityConfig) -> Credential:
    return Credential(TOKEN_HEADER, sec.token(), what="mesh token")


def api_key_credential(api_key: str) -> Credential:
    return Credential(API_KEY_HEADER, api_key, scheme="Bearer ", what="API key")


class RequireCredential(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call without the credential (health checks stay open)."""

    def __init__(self, credential: Credential) -> None:
        self.credential = credential

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS or self.credential.accepts(details.invocation_metadata):
            return handler
        return rejecting(handler, f"{self.credential.what}: missing or wrong (header {self.credential.header!r})")


def rejecting(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED before reading anything."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a streaming handler must be

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who made a call, as far as the server can tell: the API key it carried (a fingerprint), the
    TLS client certificate's names, and the peer's host (without its port, so a client's new
    connections are the same caller)."""
    parts = []
    key = api_key_credential("").presented(context.invocation_metadata())
    if key:
        parts.append("key:" + hashlib.sha256(key.encode()).hexdigest()[:32])
    auth = context.auth_context() or {}
    names = [*auth.get("x509_common_name", []), *auth.get("x509_subject_alternative_name", [])]
    if names:
        parts.append("tls:" + ",".join(sorted(n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names)))
    parts.append("peer:" + peer_host(context.peer() or ""))
    return " ".join(parts)


def peer_host(peer: str) -> str:
    """"ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7"; "ipv6:[::1]:5" -> "ipv6:[::1]"; others unchanged."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rsplit(':', 1)[0]}"
    return peer


# ---- clients -----------------------------------------------------------------------------------

def _details_with(details, metadata: tuple[tuple[str, str], ...]):
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()), *metadata)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, md, details.credentials, details.wait_for_ready)


class _AioMetadata:
    """Adds the credentials' metadata to every call of an aio channel (one subclass per call kind:
    an aio channel files each interceptor under the first kind it is an instance of)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_details_with(details, self.metadata), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_details_with(details, self.metadata), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(_details_with(details, self.metadata), request_iterator)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(_details_with(details, self.metadata), request_iterator)


def aio_interceptors(metadata: tuple[tuple[str, str], ...]) -> list:
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    return [k(metadata) for k in kinds] if metadata else []


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, details, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = (*(details.metadata or ()), *metadata)
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


class SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the credentials' metadata to every call of a sync channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _call(self, continuation: Callable, details, request):
        return continuation(_SyncDetails(details, self.metadata), request)

    intercept_unary_unary = _call
    intercept_unary_stream = _call
    intercept_stream_unary = _call
    intercept_stream_stream = _call
