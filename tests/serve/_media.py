"""Media as a chat client sends them: a PNG data URL, a base64 16-bit WAV."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
from PIL import Image as PILImage

__all__ = ["png_data_url", "wav_base64"]


def png_data_url(pixels: np.ndarray) -> str:
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def wav_base64(samples: np.ndarray, rate: int = 16000) -> str:
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes((samples * 32767).astype("<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()
