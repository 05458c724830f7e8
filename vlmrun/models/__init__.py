"""Model implementations, one file per family, and the registry that picks one from HF `architectures`."""

from vlmrun.models.registry import get_model_class
from vlmrun.models.vision_common import VisionEmbeddings

__all__ = ["VisionEmbeddings", "get_model_class"]
