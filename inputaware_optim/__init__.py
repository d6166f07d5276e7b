"""PyTorch optimizers that see the inputs that produced each gradient."""

from .adamw import InputAwareAdamW
from .base import InputAwareOptimizer
from .capture import Capture, unwrap_model
from .inputs import Call, Captured, Inputs, UncapturedInputsWarning
from .sgd import InputAwareSGD

__version__ = "0.1.0"

__all__ = [
    "Call",
    "Capture",
    "Captured",
    "InputAwareAdamW",
    "InputAwareOptimizer",
    "InputAwareSGD",
    "Inputs",
    "UncapturedInputsWarning",
    "__version__",
    "unwrap_model",
]
