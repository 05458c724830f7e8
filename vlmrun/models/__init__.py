"""Model implementations, one file per family, shared blocks in `blocks/`, and the registry that picks one."""

from vlmrun.models.base import Model
from vlmrun.models.blocks.vision_common import VisionEmbeddings
from vlmrun.models.registry import get_model_class, load_model

__all__ = ["Model", "VisionEmbeddings", "get_model_class", "load_model"]
