"""mmtrain: plan, feed, train and evaluate multimodal models, from a laptop core to a GPU cluster."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mmtrain")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

# Model functions import torch; they are resolved on first use so that `import mmtrain.spec`
# and the planner stay torch-free and start in milliseconds.
_LAZY = {"create_model", "load_model", "save_model"}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        from mmtrain.models import build

        return getattr(build, name)
    raise AttributeError(f"module 'mmtrain' has no attribute {name!r}")
