"""``prefixserve bench serve``: a load generator for any OpenAI-compatible endpoint.

Modules: ``workloads`` (seeded prompt streams: shared prefix, multi-turn chat, prefix
repetition, Zipf prefixes, random; and the engine benchmark's chat requests that the other
serving benchmarks send), ``client`` (streaming HTTP requests, one timing record each; every
serving benchmark's client), ``metrics`` (``vllm bench serve``'s labels and JSON keys, plus
cached-token ratio and per-replica counts), ``cli`` (``main(argv)``). Failures of single
requests are counted and reported, never raised; bad arguments raise ``ValueError`` / exit
with a usage error.
"""
