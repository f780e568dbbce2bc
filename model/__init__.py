"""The DeepSeek-V3 model family on deepinfer ops: checkpoint loader, model, paged-cache engine, offline API.

    from deepinfer.model import LLM, SamplingParams
    llm = LLM()                                   # the embedded model (trained on Python code), no download
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=16, temperature=0))
    print(out[0].outputs[0].text)

The model computes only through ``deepinfer.ops``, so it runs unchanged on every backend.
"""

from .checkpoint import Checkpoint, expected_layout
from .config import ModelConfig
from .deepseek_v3 import DeepseekV3
from .embedded import default_checkpoint
from .engine import LLMEngine
from .errors import CheckpointError, ParallelError, RankDivergenceError, RequestError, StructuredOutputError
from .llm import LLM
from .moe import ExpertParallel
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "Checkpoint",
    "CheckpointError",
    "CompletionOutput",
    "DeepseekV3",
    "ExpertParallel",
    "LLMEngine",
    "ModelConfig",
    "ParallelError",
    "RankDivergenceError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputError",
    "default_checkpoint",
    "expected_layout",
]
