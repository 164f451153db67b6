"""Stream: shards -> training batches, online, in a deterministic and resumable order.

The epoch order as a pure function of a few integers (`order`), the `StreamingLoader` that
splits it over ranks and workers (`loader`), decoding and augmenting each modality (`media`,
`transforms`, the pre-decoded image cache `decoded_cache`), text to ids (`tokenizer`), and for
language models conversations (`conversations`), their chat templates (`chat_templates`), rows
packed from them (`packing`) and the batches they make (`conversation_batches`). Reads shards
through `data.storage`; knows nothing of how they were built.
"""
