"""What an image pipeline reads and writes: an input image file's pixels, the output path
checked before any work, the PNG encoded and written whole or not at all, and the result
that reports it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from omni.compute.diffusion import to_png
from omni.graph.dsl import node

__all__ = ["check_out", "read_pixels", "save_png", "write_file"]


def read_pixels(path: str) -> np.ndarray:
    """RGB pixels, uint8 ``[H, W, 3]``, of the image file at `path` (PNG, JPEG or another
    format Pillow reads); ValueError naming the input ``image`` when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return np.asarray(picture.convert("RGB"))
    except FileNotFoundError:
        raise ValueError(f"image={path!r}: no such file") from None
    except UnidentifiedImageError:
        raise ValueError(f"image={path!r} is not an image (PNG or JPEG expected)") from None
    except OSError as exc:  # a folder, no permission, a truncated file
        raise ValueError(f"image={path!r} cannot be read: {exc.strerror or exc}") from None


@node
async def check_out(out: str, png: bool) -> str:
    """The absolute path to write the PNG to, once it is known to be writable ("" with
    `png` and no `out`: the result carries the PNG instead of a file)."""
    if not isinstance(png, bool):
        raise ValueError(f"png must be true or false, got {png!r}")
    if png and out == "":
        return ""
    if not isinstance(out, str) or not out.strip():
        raise ValueError(f"out must be the path of the PNG to write, got {out!r}")
    path = Path(out).expanduser().resolve()
    if path.suffix.lower() != ".png":
        raise ValueError(f"out={out!r} must end in .png")
    if path.is_dir():
        raise ValueError(f"out={out!r} is a folder, not a file")
    if not path.parent.is_dir():
        raise ValueError(f"out={out!r}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"out={out!r}: no permission to write there")
    return str(path)


def write_file(path: str, data: bytes) -> None:
    """`data` to `path`, whole or not at all (a temporary file renamed over it); ValueError
    naming the path when it cannot be written."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".omni-", suffix=".png.tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None


@node(thread=True)
def save_png(painted: dict[str, Any], path: str, png: bool) -> dict[str, Any]:
    """Encode the painted image (``{"image": uint8 [H, W, 3], "usage": ...}``) as PNG, write
    it to `path` (nothing for ""), report it with its prompts' usage (and the PNG's bytes
    under "png" when `png`: what ``POST /v1/images/generations`` answers with)."""
    image = painted["image"]
    data = to_png(image)
    if path:
        write_file(path, data)
    height, width, _ = image.shape
    report: dict[str, Any] = {"out": path or None, "width": width, "height": height,
                              "png_bytes": len(data), "usage": painted["usage"]}
    return {**report, "png": data} if png else report
