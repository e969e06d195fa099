"""castspec: exact speculative decoding with cost-aware trees from one-pass block drafters (CAST)."""
from .config import DecodeConfig
from .engine import Engine, GenerateResult, load

__all__ = ["load", "Engine", "GenerateResult", "DecodeConfig"]
__version__ = "0.1.0"
