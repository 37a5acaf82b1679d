"""The image families Omni serves from a diffusers pipeline folder, told apart by the folder's
``model_index.json`` (its ``_class_name``). Why one home: the families' loaders, the library's
pipelines and the example all choose by it, and a folder of a family Omni does not serve is
refused in one line that names the ones it does."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["FAMILIES", "check_family", "image_family"]

# model_index.json's _class_name -> the family Omni serves it as
FAMILIES = {"ZImagePipeline": "z_image", "Cosmos3OmniPipeline": "cosmos3"}


def image_family(folder: str | Path) -> str:
    """The image family of a diffusers folder, from its ``model_index.json`` ``_class_name``.

    Raises:
        ValueError: no readable model_index.json, a pipeline of a family Omni does not serve
            (the message names it and the ones served), or a component the index names
            whose folder is missing.
    """
    index = Path(folder) / "model_index.json"
    try:
        fields = json.loads(index.read_text())
        name = fields.get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{folder}: cannot read {index.name} ({exc}); give a diffusers "
                         "pipeline folder") from None
    if name not in FAMILIES:
        raise ValueError(f"{folder}: a {name} (model_index.json's _class_name), which Omni "
                         f"does not serve; it serves {', '.join(FAMILIES)}")
    missing = [part for part, value in fields.items() if isinstance(value, list)
               and value[0] is not None and not (Path(folder) / part).is_dir()]
    if missing:
        raise ValueError(f"{folder}: model_index.json names the component(s) "
                         f"{', '.join(missing)}, whose folder(s) are missing")
    return FAMILIES[name]


def check_family(folder: str | Path, family: str) -> None:
    """ValueError unless `folder` is a served folder (`image_family`) of `family`."""
    found = image_family(folder)
    if found != family:
        raise ValueError(f"{folder}: a {found} folder, not {family} (load it as {found})")
