"""Ingest: raw files, tables or shards -> filtered WebDataset shards and their manifest, offline.

What a build reads (`sources`), its options (`options`), the build itself (`pipeline`), the
per-item work in worker processes (`process`, `conversation_items` for chat data, `video_clips`,
with `outcome` what they take and give back), the sample filters (`filters`), the resume journal
(`journal`), and `inspect`, which reports on and verifies the shards a build wrote. Decodes with
`data.stream`'s decoders (so a kept sample is one the loader reads) and writes through
`data.storage`.
"""
