"""DeepseekV32ForCausalLM (DeepSeek-V3.2) and GlmMoeDsaForCausalLM (GLM-5): MLA with DSA sparse
attention (the lightning indexer's top-k keys per query), grouped sigmoid gate, shared experts."""
from moemesh.models.deepseek_v32.config import DEEPSEEK_V32, GLM_MOE_DSA, parse_config
from moemesh.models.deepseek_v32.model import DeepseekV32ForCausalLM
from moemesh.models.architecture import ArchitectureSpec

ARCHITECTURE = (
    ArchitectureSpec(DEEPSEEK_V32, parse_config, DeepseekV32ForCausalLM),
    ArchitectureSpec(GLM_MOE_DSA, parse_config, DeepseekV32ForCausalLM),
)
