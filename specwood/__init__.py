"""specwood: lossless, hardware-aware, tree-based speculative decoding."""
from specwood.engine.api import Engine, load
from specwood.engine.config import SchedulerConfig
from specwood.engine.output import GenerationResult
from specwood.errors import SpecwoodError
from specwood.sampling import SamplingParams
from specwood.version import __version__
import specwood.planner  # noqa: E402,F401 - registers the planner's methods (auto, prior)

__all__ = ["Engine", "GenerationResult", "SamplingParams", "SchedulerConfig", "SpecwoodError", "load", "__version__"]
