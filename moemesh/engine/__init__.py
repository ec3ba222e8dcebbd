"""The in-process engine: paged KV cache, continuous-batching scheduler, sampling, `LLMEngine`."""
from moemesh.engine.config import EngineConfig
from moemesh.engine.llm_engine import LLMEngine
from moemesh.engine.outputs import GenerationResult, StepFailed, StepOutput
from moemesh.engine.sampling_params import SamplingParams

__all__ = ["EngineConfig", "GenerationResult", "LLMEngine", "SamplingParams", "StepFailed", "StepOutput"]
