"""kvturn: multi-turn prefill/decode serving on Ray Serve and vLLM.

`graph` is the Serve application builder (`serve run app:graph`); `build(cfg)` binds it
from an `AppConfig`. Both come from `app.builder`, imported when first asked for, so the
pure packages (`app.turn`) can be imported without Ray.

Packages, by the process their code runs in (docs/architecture.md):
- `app.api`: the Ingress replicas' HTTP and handle surface.
- `app.turn`: the turn pipeline, inside the ingress.
- `app.engines`: the prefill and decode replicas.
- `app.fleet`: routing, drains, memory and autoscaling across replicas.
"""

from typing import Any

__all__ = ["build", "graph"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from app import builder

        return getattr(builder, name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
