"""Storage: where shard bytes live and how they are reached, below everything that reads them.

The manifest format (`manifest`), tar shards read in place (`tar_index`) and written atomically
(`shard_writer`), shard lists (`shard_lists`), shards in S3-compatible object storage (`s3`)
behind a bounded local cache (`remote_cache`) filled ahead of the reader (`prefetch`), and on
top `shards.ShardSet`, the flat, indexed view of a list of shards, local or remote, that the
loader, the build and the tools read from. Nothing here decodes a sample.
"""
