"""kvstrata: a KV-cache-centric LLM inference engine."""

from kvstrata.config import EngineConfig
from kvstrata.engine.beam_search import BeamSearchOutput, BeamSearchParams
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.lora_request import LoRARequest
from kvstrata.engine.outputs import RequestOutput
from kvstrata.engine.pooling_params import PoolingParams
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.structured_output import StructuredOutput
from kvstrata.errors import KvstrataError
from kvstrata.llm import LLM

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "EngineConfig", "KvstrataError", "LLMEngine", "LoRARequest",
           "PoolingParams", "RequestOutput", "SamplingParams", "StructuredOutput"]
