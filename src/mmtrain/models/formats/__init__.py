"""Checkpoint formats: one module per external layout, mapping its weights onto mmtrain's names.

A format module is one mapping between a checkpoint layout mmtrain did not write (OpenCLIP's
`CLIP`, a Hugging Face CLIP / SigLIP, Llama / Qwen2 or LLaVA folder) and the parameter names of
the model `create_model(spec)` builds: it infers the spec from the peer's config, maps every key
explicitly both ways, and refuses what it cannot express with the field to blame. Each mapping is
tested against the peer's own forward (OpenCLIP's, transformers'), not only against itself.
`openclip` and the `hf_*` mappings share `keys` (checking a state dict's keys and shapes);
the `hf_*` ones also share `hf_common` (folders, config.json, streaming writes), and `hf` picks
the HF mapping for a folder or a spec.
"""
