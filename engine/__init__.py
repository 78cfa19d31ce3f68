"""mtpchat's inference engine: hybrid Gated-DeltaNet models decoded with their own MTP head as a lossless
self-speculative drafter. No Textual import here."""

from .api import DecodeControl, Engine, GenerationSettings, ModelInfo, load_engine
from .errors import EngineError

__all__ = ["DecodeControl", "Engine", "EngineError", "GenerationSettings", "ModelInfo", "load_engine"]
