"""mmtrain: plan, feed, train and evaluate multimodal models, from a laptop core to a GPU cluster."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("mmtrain")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
