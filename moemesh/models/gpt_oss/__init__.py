"""GptOssForCausalLM: attention sinks, alternating sliding/full attention, biased router, fused
experts with biases and the clamped SwiGLU (dense or MXFP4 on disk)."""
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.gpt_oss.config import parse_config
from moemesh.models.gpt_oss.model import GptOssForCausalLM

ARCHITECTURE = ArchitectureSpec("GptOssForCausalLM", parse_config, GptOssForCausalLM)
