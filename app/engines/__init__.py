"""The engine replicas: the prefill and decode Serve deployments, the vLLM adapter, engine
setup and sizing, the embedded model, and the typed calls between ingress and engines (wire)."""
