"""`mmtrain quickstart`: the offline demos, one concept per module.

- `config`: `QuickstartConfig`, the defaults of each demo, `--modalities` parsing.
- `common`: what every demo shares (output folder, phase clock, shard building, the run's
  `mmtrain train` config, `QuickstartResult`); `budget`: timing steps against `--minutes`.
- `emoji_data`: the Twemoji image-caption set (names, captions, split, attribution).
- `image_text`: the default demo, a tiny CLIP on the emoji (`run_image_text`).
- `modalities`, `speech`, `series`: `--modalities`, with spoken captions (eSpeak NG) and
  BasicMotions sensor recordings bound to text.
- `runner`: `run_quickstart`, which picks the demo.

The demos import `common`, `budget` and `config`, never each other's run code (the
`--modalities` demo reuses the image-text model description, `image_text.quickstart_spec`).
"""

from mmtrain.quickstart.common import QuickstartResult
from mmtrain.quickstart.config import QuickstartConfig, make_config
from mmtrain.quickstart.runner import run_quickstart

__all__ = ["QuickstartConfig", "QuickstartResult", "make_config", "run_quickstart"]
