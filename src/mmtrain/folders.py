"""The names of the files in mmtrain's folders, in one place for the writers and the readers.

A model folder (`mmtrain.save_model`, `mmtrain convert`, a finished run) holds `spec.yaml` (the
`ModelSpec`) and the weights: `model.safetensors`, or shards listed in
`model.safetensors.index.json` past 5 GB a file (Hugging Face's convention).

A run folder (`mmtrain train`) is a model folder once training finished, and holds besides:
`config.yaml` (the resolved run config), `metrics.jsonl` (a row per logged step, the plan
record, validation rows), `eval.json` (the last evaluation), `checkpoints/step_N/` and, for a
denoiser, `samples/step_N.png` (a grid of samples at each validation).

Plain names only (no torch): the report reads run folders without importing the trainer.
"""

SPEC_FILE = "spec.yaml"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.json"
CHECKPOINT_DIR = "checkpoints"
SAMPLES_DIR = "samples"  # a denoiser's sample grids, one per validation: step_N.png
