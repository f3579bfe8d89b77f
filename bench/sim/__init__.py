"""A trace-driven discrete-event simulation of the fleet (`python -m bench.sim`).

Reading order: `costs` (what an engine step, a NIXL read and a hop cost), `params`
(every parameter and its source), `engine` (one vLLM engine's step loop), `policy` (the
app's own placement, pacing and handle store, driven by simulated time), `fleet` (a
turn's life per mode), `study` (the fleet study's levels and figures), `validate`
(against the measured CPU study and the published Qwen3-32B case), `project` (GPU
projections).

The event loop is simpy's (processes as generators, one clock), not a home-made one:
agents, legs and engine step loops are plain generator functions over its events, and
the app's decisions read its clock. Engine costs follow the roofline form of Vidur's
and DistServe's simulators (compute per token, attention per context token, a memory
read per step) with few parameters, since the CPU figures we can fit them to are few.
"""
