"""PrHS selectors: CIS, PSAW, ETF, PrHS (CPE) and the baselines, one module each, by name.

Importing the package registers every selector in :data:`prhs_core.registry.selectors`; the
``prhs.selectors`` entry point does this on a host's first lookup.
"""

from prhs_selectors import (
    cis,
    compkv,
    dense,
    double_sparsity,
    etf,
    h2o,
    hshare,
    louver,
    oracle,
    prhs,
    psaw,
    quest,
    rabitq,
    streaming,
)
from prhs_selectors.base import BaseSelector
from prhs_selectors.cis import CIS, CISConfig
from prhs_selectors.compkv import CompKV, CompKVConfig
from prhs_selectors.dense import Dense, DenseConfig
from prhs_selectors.double_sparsity import DoubleSparsity, DoubleSparsityConfig
from prhs_selectors.etf import ETF, ETFConfig
from prhs_selectors.h2o import H2O, H2OConfig
from prhs_selectors.hshare import HShare, HShareConfig
from prhs_selectors.louver import Louver, LouverConfig
from prhs_selectors.oracle import Oracle
from prhs_selectors.prhs import PrHS, PrHSConfig
from prhs_selectors.psaw import PSAW, PSAWConfig
from prhs_selectors.quest import Quest, QuestConfig
from prhs_selectors.rabitq import RaBitQ, RaBitQConfig
from prhs_selectors.streaming import Streaming

__version__ = "0.1.0"

__all__ = [
    "CIS",
    "ETF",
    "H2O",
    "PSAW",
    "BaseSelector",
    "CISConfig",
    "CompKV",
    "CompKVConfig",
    "Dense",
    "DenseConfig",
    "DoubleSparsity",
    "DoubleSparsityConfig",
    "ETFConfig",
    "H2OConfig",
    "HShare",
    "HShareConfig",
    "Louver",
    "LouverConfig",
    "Oracle",
    "PSAWConfig",
    "PrHS",
    "PrHSConfig",
    "Quest",
    "QuestConfig",
    "RaBitQ",
    "RaBitQConfig",
    "Streaming",
    "__version__",
    "cis",
    "compkv",
    "dense",
    "double_sparsity",
    "etf",
    "h2o",
    "hshare",
    "louver",
    "oracle",
    "prhs",
    "psaw",
    "quest",
    "rabitq",
    "streaming",
]
