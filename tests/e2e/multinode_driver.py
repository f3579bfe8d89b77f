"""Driver for the two-node test: runs against a Ray cluster given by RAY_ADDRESS, deploys
prefill on the node offering `prefill_pool` and decode on the one offering `decode_pool`,
holds a 2-turn conversation through the ingress handle and prints a JSON report.

    python -m tests.e2e.multinode_driver
"""

from __future__ import annotations

import json
import os

import ray
from ray import serve

from app.builder import build
from app.engines.wire import ReplicaQuery
from tests.conftest import pd_config

SYSTEM = "You are a helpful assistant. Use the tools when they help, and answer briefly. " * 2


def main() -> None:
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    cfg = pd_config(
        app_name="twonode",
        **{
            "decode.num_replicas": 1,
            "prefill.resources": {"prefill_pool": 1},
            "decode.resources": {"decode_pool": 1},
            "env": {"UCX_NET_DEVICES": "lo"},
        },
    )
    serve.start(http_options={"host": "127.0.0.1", "port": 8124})
    ingress = serve.run(build(cfg), name="twonode", route_prefix="/")
    prefill = serve.get_deployment_handle("PrefillServer", "twonode")
    decode = serve.get_deployment_handle("DecodeServer", "twonode")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Across two nodes, please. " * 3},
    ]
    turns = []
    for _turn in range(2):
        before = prefill.stats.remote(ReplicaQuery()).result()
        body = {
            "model": cfg.model_name,
            "messages": messages,
            "max_tokens": 20,
            "temperature": 0,
            "return_token_ids": True,
        }
        reply = ingress.chat.remote(body, session_id="two-nodes").result()
        after = prefill.stats.remote(ReplicaQuery()).result()
        turns.append(
            {
                "prompt_tokens": reply["usage"]["prompt_tokens"],
                "completion_tokens": reply["usage"]["completion_tokens"],
                "cached_tokens": reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                "prefill_external": after["prompt_tokens_external"] - before["prompt_tokens_external"],
                "kvturn": reply["kvturn"],
            }
        )
        messages = messages + [
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": "Tool result: ok, 3 items. " * 4},
        ]
    report = {
        "turns": turns,
        "prefill": prefill.stats.remote(ReplicaQuery()).result(),
        "decode": decode.stats.remote(ReplicaQuery()).result(),
    }
    print("REPORT " + json.dumps(report))
    serve.shutdown()


if __name__ == "__main__":
    main()
