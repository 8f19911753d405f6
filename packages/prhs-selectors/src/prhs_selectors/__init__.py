"""PrHS selectors: CIS, PSAW, ETF and the baselines, one module each, by name.

Importing the package registers every selector in :data:`prhs_core.registry.selectors`; the
``prhs.selectors`` entry point does this on a host's first lookup.
"""

from prhs_selectors import cis, cpe, dense, h2o, oracle, prefill, quest, streaming
from prhs_selectors.base import BaseSelector
from prhs_selectors.cis import CIS, CISConfig
from prhs_selectors.cpe import CPE, CPEConfig
from prhs_selectors.dense import Dense
from prhs_selectors.h2o import H2O, H2OConfig
from prhs_selectors.oracle import Oracle
from prhs_selectors.prefill import ETF, PSAW, ETFConfig, PSAWConfig
from prhs_selectors.quest import Quest, QuestConfig
from prhs_selectors.streaming import Streaming

__version__ = "0.1.0"

__all__ = [
    "CIS",
    "CPE",
    "ETF",
    "H2O",
    "PSAW",
    "BaseSelector",
    "CISConfig",
    "CPEConfig",
    "Dense",
    "ETFConfig",
    "H2OConfig",
    "Oracle",
    "PSAWConfig",
    "Quest",
    "QuestConfig",
    "Streaming",
    "__version__",
    "cis",
    "cpe",
    "dense",
    "h2o",
    "oracle",
    "prefill",
    "quest",
    "streaming",
]
