"""specwood: lossless, hardware-aware, tree-based speculative decoding."""
from specwood.engine.api import Engine, load
from specwood.engine.output import GenerationResult
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "SamplingParams", "SpecwoodError", "load", "__version__"]
