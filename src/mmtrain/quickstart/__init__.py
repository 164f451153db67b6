"""`mmtrain quickstart`: the offline demos, one concept per module.

- `config`: `QuickstartConfig`, the defaults of each demo, `--modalities` parsing.
- `common`: what every demo shares (output folder, phase clock, shard building, the run's
  `mmtrain train` config, `QuickstartResult`); `budget`: timing steps against `--minutes`.
- `emoji_data`: the Twemoji image-caption set (names, captions, split, attribution).
- `image_text`: the default demo, a tiny CLIP on the emoji (`run_image_text`).
- `modalities`, `speech`, `series`: `--modalities`, with spoken captions (eSpeak NG) and
  BasicMotions sensor recordings bound to text.
- `vlm`, `vlm_data`: `--vlm`, LLaVA's two stages on the emoji as conversations.
- `vlm_docs`, `docs_data`: `--vlm-docs`, a native-resolution VLM reading numbers off pages.
- `vlm_video`, `video_data`: `--vlm-video`, the same shape of VLM saying what a shape does in
  short clips, with the frames in order and reversed.
- `native_demo`: what `--vlm-docs` and `--vlm-video` share (their common settings, the
  tiny-qwen2-vl spec over their BPE, the training config, the held-out answers).
- `diffusion`, `emoji_classes`: `--diffusion`, a class-conditional DiT drawing emoji of ten
  classes, scored by FD and conditional accuracy in a CLIP's features.
- `stage0`: the image-text CLIP that `--vlm` (its vision tower) and `--diffusion` (its feature
  extractor) start from, trained here or given with `--clip`.
- `runner`: `run_quickstart`, which picks the demo.

The demos import `common`, `budget` and `config`, never each other's run code (the
`--modalities` demo reuses the image-text model description, `image_text.quickstart_spec`;
`stage0` runs the image-text demo as the first stage of the others).
"""

from mmtrain.quickstart.common import QuickstartResult
from mmtrain.quickstart.config import QuickstartConfig, make_config
from mmtrain.quickstart.runner import run_quickstart

__all__ = ["QuickstartConfig", "QuickstartResult", "make_config", "run_quickstart"]
