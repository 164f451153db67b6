"""Data: from raw files to training batches, in three parts that import one way.

`storage` (shards, their manifest, object storage and its local cache) is at the bottom;
`stream` (order, loader, decoders, transforms, tokenizer, conversations, packing) reads from it;
`ingest` (sources, the build, filters, journal, inspect) sits on both. Nothing here imports the
planner, the trainer, the evaluator or the commands.
"""
