"""Compute Flow: prompts, multimodal prefix keys, sampling, engines.

`Prompt` (text, images, audio) flattens to token ids whose page keys carry media digests;
`SamplingParams` speaks SGLang's terms and any `Sampler` turns a forward pass into the next
input (`TokenSampler` for tokens; a diffusion sampler for latents); `TorchEngine` is the
reference engine serving a Llama / Qwen2 / Qwen3 decoder from the KV store (and chatting
through a checkpoint's own chat template: `TorchEngine.chat`). `ZImageText` computes a Z-Image
folder's text condition on that engine, and `ZImage` paints from it with the folder's own
diffusers modules. Importing this
package imports torch.
"""

from omni.compute._diffusion_modules import FlowMatchEulerSampler
from omni.compute.cosmos3 import Cosmos3
from omni.compute.diffusion import DiffusionResult, ImageGenerator
from omni.compute.engine import GenerateResult, TokenStream, TorchEngine
from omni.compute.prompt import Audio, Image, Prompt, Text
from omni.compute.sampling import Sampler, SamplingParams, TokenSampler
from omni.compute.tokenizer import ByteTokenizer
from omni.compute.z_image import ZImage, ZImageText

__all__ = ["Audio", "ByteTokenizer", "Cosmos3", "DiffusionResult", "FlowMatchEulerSampler",
           "GenerateResult", "Image", "ImageGenerator", "Prompt", "Sampler", "SamplingParams",
           "Text", "TokenSampler", "TokenStream", "TorchEngine", "ZImage",
           "ZImageText"]
