"""The HTTP and handle surface, run by the Ingress replicas: routes, the three APIs
(chat and completions, Responses, Messages), API keys and quotas, tokenizer, the shaping of
turn events into response bodies, and the ingress's metrics."""
