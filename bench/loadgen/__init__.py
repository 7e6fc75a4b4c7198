"""``prefixserve bench serve``: a load generator for any OpenAI-compatible endpoint.

Modules: ``workloads`` (seeded prompt streams: shared prefix, multi-turn chat, prefix
repetition, Zipf prefixes, random), ``client`` (streaming HTTP requests, one timing record
each), ``metrics`` (``vllm bench serve``'s labels and JSON keys, plus cached-token ratio and
per-replica counts), ``cli`` (``main(argv)``). Failures of single requests are counted and
reported, never raised; bad arguments raise ``ValueError`` / exit with a usage error.
"""
