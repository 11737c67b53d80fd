"""Where models come from: the hubs a node downloads from (`[sources.*]`), as a node, `helexa
chat` and `LLM(...)` reach them (hub.py), and what a download of a repository fetches, with
its progress (fetch.py). No torch, no engine: the node runs it before a model's worker
starts, so that tokens stay in the node's process."""
