"""The turn pipeline, run inside the ingress: a turn's legs through the engines, its
pacing and placement, and its types. Imports neither Ray nor vLLM (tests/test_layout.py)."""
