"""Z-Image's text condition computed by Omni's engine, as diffusers' `ZImagePipeline` computes it.

A Z-Image folder (diffusers' layout: ``model_index.json`` naming ``ZImagePipeline``) keeps its
text encoder, a Qwen3 language model, in ``text_encoder/`` and its tokenizer in
``tokenizer/``. diffusers renders a prompt as a one-message conversation with the tokenizer's
own chat template (``enable_thinking=True``, the generation prompt added), keeps its first
`MAX_SEQUENCE_LENGTH` tokens (the template's counted), and conditions the DiT on every token's
hidden state after the encoder's second-to-last layer (transformers' ``hidden_states[-2]``,
before any norm); padding is masked out. The negative prompt (``""`` when absent) is encoded
the same way. Here the encoder is Omni's `TorchEngine`, which runs only the layers that state
needs, and the prompt is never padded. diffusers' own modules (the DiT, the VAE, the
scheduler) take the result as ``prompt_embeds`` / ``negative_prompt_embeds``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omni._openmp import run_in_worker
from omni.compute.engine import TorchEngine
from omni.compute.prompt import Text

__all__ = ["MAX_SEQUENCE_LENGTH", "ZImageText"]

MAX_SEQUENCE_LENGTH = 512  # tokens of a rendered prompt diffusers keeps


class ZImageText:
    """The text side of a Z-Image folder: its tokenizer's rendering and its text encoder's
    condition.

    Args:
        engine: the text encoder, with the folder's tokenizer (`from_pretrained` loads both).
        max_sequence_length: how many tokens of a rendered prompt are kept.
    """

    def __init__(self, engine: TorchEngine, max_sequence_length: int = MAX_SEQUENCE_LENGTH):
        if engine.tokenizer is None or engine.tokenizer.chat_template is None:
            raise ValueError(f"{engine.model_id}: Z-Image's text encoder needs a tokenizer "
                             "with a chat template (tokenizer/ of the folder)")
        if engine.config.num_layers < 2:
            raise ValueError(f"{engine.model_id}: Z-Image reads the second-to-last layer of "
                             f"its text encoder, which has {engine.config.num_layers}")
        self.engine = engine
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, folder: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> ZImageText:
        """The text encoder of the Z-Image folder `folder` (``text_encoder/`` with
        ``tokenizer/``) on `device` in `dtype`.

        Raises:
            ValueError: as `TorchEngine.from_pretrained`, or no tokenizer with a template.
        """
        root = Path(folder)
        engine = TorchEngine.from_pretrained(root / "text_encoder", tokenizer=root / "tokenizer",
                                             store=None, dtype=dtype, device=device,
                                             model_id=f"{root.resolve().name}/text_encoder")
        return cls(engine)

    @property
    def layer(self) -> int:
        """The hidden states read: transformers' ``hidden_states[-2]``."""
        return self.engine.config.num_layers - 1

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids the encoder reads for `prompt` (rendered, cut to the kept length)."""
        if not isinstance(prompt, str):
            raise ValueError(f"a Z-Image prompt is text, got {type(prompt).__name__}")
        ids = self.engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            enable_thinking=True)
        return list(ids)[: self.max_sequence_length]

    def condition(self, prompt: str) -> torch.Tensor:
        """`prompt`'s condition ``[T, hidden]``: every token's hidden state after the text
        encoder's second-to-last layer. Runs the encoder in the calling thread (see
        `encode`)."""
        tokens = self.engine.prepare(Text(self.prompt_ids(prompt)))
        return self.engine.runner.hidden_at(tokens, self.layer)

    async def encode(self, prompt: str) -> torch.Tensor:
        """`condition`, computed in a worker thread."""
        return await run_in_worker(self.condition, prompt)

    def __repr__(self) -> str:
        return (f"<ZImageText {self.engine.model_id} layer={self.layer} "
                f"max_tokens={self.max_sequence_length}>")
