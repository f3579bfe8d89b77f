"""kvturn: multi-turn prefill/decode serving on Ray Serve and vLLM.

`graph` is the Serve application builder (`serve run app:graph`).
"""

from app.builder import build, graph

__all__ = ["build", "graph"]
