"""PyTorch optimizers that see the inputs that produced each gradient."""

from .accounting import PrivacyAccountant
from .adamw import InputAwareAdamW
from .base import InputAwareOptimizer
from .capture import Capture, unwrap_model
from .coverage import Coverage, CoverageWarning, Treatment
from .dp import DPSGD, DPAdamW, PerSampleClipping
from .eva import Eva, EvaPreconditioner
from .foof import FOOF, FOOFPreconditioner
from .hooks import InputsHookHandle
from .inputs import Call, Captured, Inputs, UncapturedInputsWarning
from .integrations import __getattr__ as __getattr__  # the trainer callbacks, built on first use
from .kfac import KFAC, KFACPreconditioner
from .layers import Layer, LayerKind, layer_kind, register_layer
from .lazy_adamw import LazyAdamW
from .moe import ExpertLoads, LoadBalancing
from .monitor import Monitor
from .nlms import NLMS, InputNormalization
from .nonfinite import NonFiniteError, NonFiniteFinder, NonFiniteOrigin, NonFiniteWarning
from .reduction import Reduction
from .rule import Rule
from .sgd import InputAwareSGD
from .whitened_muon import WhitenedMuon, WhitenedMuonPreconditioner

__version__ = "0.4.0.dev0"

__all__ = [
    "DPSGD",
    "FOOF",
    "KFAC",
    "NLMS",
    "Call",
    "Capture",
    "Captured",
    "Coverage",
    "CoverageWarning",
    "DPAdamW",
    "Eva",
    "EvaPreconditioner",
    "ExpertLoads",
    "FOOFPreconditioner",
    "InputAwareAdamW",
    "InputAwareOptimizer",
    "InputAwareSGD",
    "InputNormalization",
    "Inputs",
    "InputsHookHandle",
    "KFACPreconditioner",
    "Layer",
    "LayerKind",
    "LazyAdamW",
    "LoadBalancing",
    "Monitor",
    "NonFiniteError",
    "NonFiniteFinder",
    "NonFiniteOrigin",
    "NonFiniteWarning",
    "PerSampleClipping",
    "PrivacyAccountant",
    "Reduction",
    "Rule",
    "Treatment",
    "UncapturedInputsWarning",
    "WhitenedMuon",
    "WhitenedMuonPreconditioner",
    "__version__",
    "layer_kind",
    "register_layer",
    "unwrap_model",
]
