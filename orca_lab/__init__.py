"""orca_lab: ORCA (OSDI'22) rebuilt to be read, run and measured."""
from orca_lab.config import PRESETS, EngineConfig, ModelConfig
from orca_lab.engine.beam_search import BeamSearchParams
from orca_lab.engine.sampling_params import SamplingParams
from orca_lab.llm import LLM, RequestsFailed

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "RequestsFailed", "EngineConfig", "ModelConfig", "PRESETS", "SamplingParams",
           "__version__"]
