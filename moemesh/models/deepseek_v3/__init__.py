"""DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2): MLA, YaRN, grouped sigmoid gate, shared experts."""
from moemesh.models.architecture import ArchitectureSpec
from moemesh.models.deepseek_v3.config import parse_config
from moemesh.models.deepseek_v3.model import DeepseekV3ForCausalLM

ARCHITECTURE = ArchitectureSpec("DeepseekV3ForCausalLM", parse_config, DeepseekV3ForCausalLM)
